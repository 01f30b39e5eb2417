"""Model definitions (the Llama family)."""
