"""Offline `LLM.chat` as vLLM's: conversations rendered by the chat template, then generated as `generate` does."""

from __future__ import annotations

import pytest

from rlserve import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
USER = [{"role": "user", "content": "Tell me a story"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_llm_chat(qwen3_dir, make_llm, generate) -> None:
    llm = make_llm(qwen3_dir)
    try:
        tokenizer = llm.get_tokenizer()
        (reference,) = generate(
            llm,
            {
                "prompt_token_ids": tokenizer.apply_chat_template(
                    USER, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            },
            GREEDY,
        )
        # One conversation, or several: each is the template's prompt, generated greedily as by generate().
        (single,) = llm.chat(USER, GREEDY, use_tqdm=False)
        assert single.prompt_token_ids == reference.prompt_token_ids
        assert single.outputs[0].token_ids == reference.outputs[0].token_ids
        prefill = [*USER, {"role": "assistant", "content": "Once upon"}]
        batch = llm.chat(
            [USER, prefill], GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True
        )
        # Each conversation's final message is left open: the user's, then the assistant's prefill.
        assert tokenizer.decode(batch[0].prompt_token_ids).endswith("<|im_start|>user\nTell me a story")
        assert tokenizer.decode(batch[1].prompt_token_ids).endswith("<|im_start|>assistant\nOnce upon")

        (with_tools,) = llm.chat(USER, GREEDY, use_tqdm=False, tools=TOOLS)
        assert '"get_weather"' in tokenizer.decode(with_tools.prompt_token_ids)
        (templated,) = llm.chat(
            USER,
            GREEDY,
            use_tqdm=False,
            chat_template="{{ hi }}{{ messages[0]['content'] }}",
            chat_template_kwargs={"hi": ">"},
        )
        assert tokenizer.decode(templated.prompt_token_ids) == ">Tell me a story"

        with pytest.raises(ValueError, match="continue_final_message"):
            llm.chat(prefill, GREEDY, continue_final_message=True)  # add_generation_prompt defaults to true
        with pytest.raises(ValueError, match="chat_template_kwargs"):
            llm.chat(USER, GREEDY, chat_template_kwargs={"tools": TOOLS})
    finally:
        llm.shutdown()
