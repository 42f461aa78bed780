"""megapipe: tensor, pipeline and data parallel training of GPT and BERT."""

__version__ = "0.1.0"
