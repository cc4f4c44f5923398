"""The engine layer: continuous batching, propose / verify / accept, sampling maths, lookahead,
per-request objects and the engine worker thread. Imports drafters, records, the bus and the
model below it; knows nothing of HTTP, stores or learners."""
