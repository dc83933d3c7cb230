"""The text front end, torch-free: what the gateway runs before a request reaches the engine
(text normalisation, prompt building, the checkpoint's configuration, reference-clip decoding, emotion
directions, long-form chunking and continuation) and what the engine reuses for its own prompts.
The gateway imports `engine.contract` and this package, nothing else of engine/."""
