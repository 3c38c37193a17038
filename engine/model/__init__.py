"""Models: where one comes from (a directory, a GGUF file, a Hub id), loading it with LoRA, its
family's layer stack (arch/), the attention, masks and recomputation the stack runs, the LM
head, content keys and adapters on disk.
"""
