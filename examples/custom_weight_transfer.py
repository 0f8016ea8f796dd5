"""Register a weight-transfer backend of your own and push an update through it.

The backend here moves weights through a safetensors file on a shared filesystem (handy when trainer and engine share
a disk but no network group): the trainer writes a file, the engine's `update_weights` names it. Any class that
implements `WeightTransferEngine` can be registered the same way, by class or as "package.module:ClassName".

    python examples/custom_weight_transfer.py
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rlserve import LLM, SamplingParams, WeightTransferConfig
from rlserve.toy import make_model_dir
from rlserve.weight_transfer import (
    LoadWeightsFn,
    WeightTransferEngine,
    WeightTransferEngineFactory,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)


@dataclass
class FileInitInfo(WeightTransferInitInfo):
    directory: str


@dataclass
class FileUpdateInfo(WeightTransferUpdateInfo):
    file_name: str = "weights.safetensors"


class FileWeightTransferEngine(WeightTransferEngine[FileInitInfo, FileUpdateInfo]):
    init_info_cls = FileInitInfo
    update_info_cls = FileUpdateInfo

    def init_transfer_engine(self, init_info: FileInitInfo) -> None:
        self.directory = Path(init_info.directory)

    def receive_weights(self, update_info: FileUpdateInfo, load_weights: LoadWeightsFn) -> None:
        tensors = load_file(str(self.directory / update_info.file_name), device=str(self.device))
        load_weights([(name, tensors[name]) for name in update_info.names])

    def discard_weights(self, update_info: FileUpdateInfo) -> None:
        pass  # nothing is in flight: the file simply stays unread

    def shutdown(self) -> None:
        pass

    @staticmethod
    def trainer_send_weights(iterator, trainer_args: dict) -> dict:
        """Write the weights; returns the update_info the engine needs."""
        weights = {name: t.detach().contiguous().cpu() for name, t in iterator}
        save_file(weights, str(Path(trainer_args["directory"]) / "weights.safetensors"))
        return dict(
            names=list(weights),
            dtype_names=[str(t.dtype).removeprefix("torch.") for t in weights.values()],
            shapes=[list(t.shape) for t in weights.values()],
        )


def main() -> list[int]:
    with tempfile.TemporaryDirectory(prefix="rlserve-custom-") as work:
        return run(Path(work))


def run(work: Path) -> list[int]:
    WeightTransferEngineFactory.register_engine("file", FileWeightTransferEngine)
    model_dir = make_model_dir(work / "model", preset="tiny")
    llm = LLM(str(model_dir), weight_transfer_config=WeightTransferConfig(backend="file"))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    before = llm.generate(["1+2="], params, use_tqdm=False)[0].outputs[0].token_ids

    # The "trainer": new weights (here: the old ones, perturbed) under checkpoint names.
    new_weights = {n: t + 0.1 * torch.randn_like(t) for n, t in load_file(str(model_dir / "model.safetensors")).items()}
    llm.init_weight_transfer_engine(dict(init_info=dict(directory=str(work))))
    update_info = FileWeightTransferEngine.trainer_send_weights(iter(new_weights.items()), dict(directory=str(work)))
    llm.start_weight_update()
    llm.update_weights(dict(update_info=update_info))
    llm.finish_weight_update(weight_version="file-1")

    after = llm.generate(["1+2="], params, use_tqdm=False)[0].outputs[0]
    print(f"before: {before}\nafter:  {after.token_ids} (weight versions {set(after.weight_versions)})")
    llm.shutdown()  # its core process reads the work directory: stopped before that is removed
    return after.token_ids


if __name__ == "__main__":
    main()
