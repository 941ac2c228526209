"""Example tasks written as plain PyTorch, the way users bring them (not the samples)."""
