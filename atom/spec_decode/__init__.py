"""Speculative decoding: proposers of draft tokens (verification is `model_ops.rejection_sampler`)."""
