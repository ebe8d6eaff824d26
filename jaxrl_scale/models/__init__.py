"""The policy: Qwen2/Qwen3/Llama and Qwen3-MoE in Flax NNX (policy.py, with attention.py,
moe.py and layers.py), LoRA adapters (lora.py), Hugging Face and PEFT checkpoints (hf.py,
peft.py) and tokenizers (tokenizer.py). Imports parallel/ and the configuration."""
