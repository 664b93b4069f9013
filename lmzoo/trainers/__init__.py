"""Trainers: the protocol (`base`), the supervised trainer, the RLHF policy trainer (`rl`) and the counting
trainer of n-gram models, with the train state and the optimizer. Below the objectives, which pick one."""
