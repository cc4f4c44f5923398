"""The bottom layer: the Llama-family transformer, checkpoint loading and conversion, the bundled
target and the target fingerprint. It imports nothing else of specd but `specd.core.errors`."""
