"""OpenAI-compatible serving over the batch engine."""
