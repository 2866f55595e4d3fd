"""A small GPT-style job with tensor + data parallelism for the demo and recovery tests."""
