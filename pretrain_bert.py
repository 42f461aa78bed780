"""Pretrain a BERT model with tensor, pipeline and data parallelism.

    python pretrain_bert.py                                   # small BERT on the embedded corpus, one CPU process
    torchrun --nproc_per_node=4 pretrain_bert.py --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2

Flags follow Megatron-LM; `python pretrain_bert.py --help` lists them.
"""

from megapipe.training.frozen_imports import frozen_imports
from megapipe.training.sigterm import SigtermNotice

if __name__ == "__main__":
    notice = SigtermNotice().install()  # before torch is imported: a SIGTERM during start-up is noted
    with frozen_imports():
        from megapipe.training.cli import main

    main("bert", notice)
