"""What the front end and the engine core (and the ranks) agree on: messages, their checks, the socket's secret,
packed tensors and small process helpers. Imports nothing from the other engine packages."""
