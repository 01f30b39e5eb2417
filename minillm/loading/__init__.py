"""Model loading: GGUF files, Hugging Face directories, tokenizers."""
