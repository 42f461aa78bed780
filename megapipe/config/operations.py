"""The operations flags (``--exit-interval``, ``--exit-duration-in-mins``,
``--exit-signal-grace-seconds``, ``--distributed-timeout-minutes``, ``--skip-train``, ``--load``,
``--mock-data``, ``--hf-dataset``, ``--num-workers``, the two scheduler-on-resume flags), checked
before any process group, one sentence per mistake.
(What they do at run time: ``megapipe/training/exits.py``.)"""

from __future__ import annotations

import os
from typing import Optional

from megapipe.config.schema import Config
from megapipe.errors import ConfigError
from megapipe.optional import require


def validate_operations(kind: str, config: Config) -> None:
    """Raise ConfigError naming the flag for a bad operations flag or combination."""
    t, data = config.training, config.data
    if t.distributed_timeout_minutes <= 0:
        raise ConfigError(f"--distributed-timeout-minutes {t.distributed_timeout_minutes:g} must be above 0: it is "
                          "how long a collective waits for a peer before failing.")
    if t.exit_interval is not None and t.exit_interval < 1:
        raise ConfigError(f"--exit-interval {t.exit_interval} must be at least 1 (iterations between the save "
                          "and the exit); drop the flag to train to --train-iters.")
    if t.exit_duration_in_mins is not None and t.exit_duration_in_mins <= 0:
        raise ConfigError(f"--exit-duration-in-mins {t.exit_duration_in_mins:g} must be above 0; drop the flag to "
                          "train to --train-iters.")
    if t.exit_signal_grace_seconds is not None:
        if t.exit_signal_grace_seconds <= 0:
            raise ConfigError(f"--exit-signal-grace-seconds {t.exit_signal_grace_seconds:g} must be above 0: it is "
                              "the time between SIGTERM and SIGKILL (Slurm's KillWait or GraceTime).")
        if not t.exit_on_sigterm:
            raise ConfigError("--exit-signal-grace-seconds needs the SIGTERM handler; drop "
                              "--no-exit-signal-handler or the grace period.")
    if t.skip_train and not t.load:
        raise ConfigError("--skip-train evaluates a checkpoint and needs --load DIR; pass the checkpoint directory.")
    if t.load and not os.path.isdir(t.load) and (t.skip_train or not same_path(t.load, t.save)):
        raise ConfigError(f"--load {t.load} does not exist; pass a checkpoint directory (or the --save directory, "
                          "to start a job that resumes itself).")
    if t.cluster_lease is not None and not t.cluster_lease.startswith(("http://", "https://")):
        raise ConfigError(f"--cluster-lease {t.cluster_lease} is not an http:// address; the scheduler service sets "
                          "it, so drop the flag when running outside the cluster.")
    if t.override_opt_param_scheduler and t.use_checkpoint_opt_param_scheduler:
        raise ConfigError("--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler exclude each "
                          "other; keep the one whose learning-rate schedule the resumed run should follow.")
    if data.mock_data:
        if kind != "gpt":
            raise ConfigError(f"--mock-data makes GPT samples only; pretrain_{kind}.py needs --data-path or the "
                              "embedded corpus.")
        if data.data_path:
            raise ConfigError("--mock-data replaces --data-path; drop one of them.")
        if data.vocab_size is None or data.vocab_size < 2:
            raise ConfigError(f"--mock-data needs --vocab-size N (at least 2, got {data.vocab_size}): the "
                              "synthetic tokens are drawn from [0, N).")
    if data.hf_dataset is not None:
        _validate_hf_dataset(kind, config)
    packing = [flag for flag, on in (("--eod-mask-loss", data.eod_mask_loss), ("--reset-position-ids",
               data.reset_position_ids), ("--reset-attention-mask", data.reset_attention_mask)) if on]
    if packing and kind != "gpt":
        raise ConfigError(f"{packing[0]} separates the documents packed into GPT samples; pretrain_{kind}.py's "
                          "samples are sentence pairs, so drop the flag.")
    if data.num_workers < 0:
        raise ConfigError(f"--num-workers {data.num_workers} must be 0 or more (0 tokenises in the training "
                          "process).")
    if not data.mock_data and data.vocab_size is not None and data.tokenizer_type != "NullTokenizer":
        raise ConfigError("--vocab-size sets the vocabulary of --mock-data and --tokenizer-type NullTokenizer only "
                          "(other tokenizers have their own); drop --vocab-size or use one of those.")


def _validate_hf_dataset(kind: str, config: Config) -> None:
    data = config.data
    if kind != "gpt":
        raise ConfigError(f"--hf-dataset makes GPT samples only; pretrain_{kind}.py needs --data-path or the "
                          "embedded corpus.")
    if data.data_path or data.mock_data:
        raise ConfigError(f"--hf-dataset replaces {'--data-path' if data.data_path else '--mock-data'}; drop one "
                          "of them.")
    require("datasets", "--hf-dataset")


def same_path(a: str, b: Optional[str]) -> bool:
    return b is not None and os.path.abspath(a) == os.path.abspath(b)
