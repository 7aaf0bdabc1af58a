"""The values the decoding loop passes around and hands back: sampling parameters, stop conditions, stats,
logprobs, chat prompts and incremental detokenization."""
