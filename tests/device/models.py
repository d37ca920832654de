"""Server flags of the models the device suites serve."""

# A synthetic lm_head of Qwen's shape (H=4096, V=151936), random bf16.
SYNTHETIC_MODEL = ["--synthetic_hidden_size=4096", "--synthetic_vocab_size=151936"]
