"""Offline pretraining (`specd pretrain`): the corpora and held-out sets (`corpus`), the target's own
responses as training data (`distill`) and the resumable training run (`pretrain`). Uses the
learner's training signal; nothing online imports it."""
