"""Vision-language MoE models in the executor: the encoder, the LLM fed by it, Hugging Face weights, synthetic batches."""
