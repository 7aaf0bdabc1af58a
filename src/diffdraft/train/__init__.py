"""Drafter training: prompts, regeneration of responses with the target, and (later) capture and fitting.

The drafter learns to predict the target's own outputs, so training data is built from original prompts
whose responses the target regenerates (DFlare A.1), not from the responses the datasets ship.
"""
