"""linearize: turn pretrained softmax-attention language models into Gated DeltaNet models."""

__version__ = "0.1.0"
