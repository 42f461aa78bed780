"""Convert checkpoints offline: to another parallel layout, from and to Hugging Face and Megatron-LM.

    # rewrite a checkpoint as a (t, p, d) = (1, 4, 1) run would save it (any layout loads
    # any checkpoint directly; this makes the files match the new layout, one per rank)
    python tools/convert_checkpoint.py reshard ckpt/ ckpt-p4/ --pipeline-model-parallel-size 4

    # a Hugging Face GPT-2, BERT, Llama, Mistral, Qwen2, Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE directory
    # (save_pretrained output, safetensors sharded or not, tokenizer.json carried along) -> megapipe checkpoint
    python tools/convert_checkpoint.py import-hf gpt2-hf/ ckpt/ --tensor-model-parallel-size 2
    torchrun --nproc_per_node 2 pretrain_gpt.py --tensor-model-parallel-size 2 --load ckpt/ --finetune ...

    # a megapipe checkpoint -> Hugging Face directory (config.json + model.safetensors)
    python tools/convert_checkpoint.py export-hf ckpt/ gpt2-out/

    # a Megatron-LM GPT or Llama-style checkpoint (torch format at any (t, p), or torch_dist) -> megapipe
    python tools/convert_checkpoint.py import-megatron megatron-ckpt/ ckpt/ --tensor-model-parallel-size 2
    # a megapipe checkpoint -> Megatron-core torch_dist (load it with --ckpt-format torch_dist)
    python tools/convert_checkpoint.py export-megatron ckpt/ megatron-out/

Sources may be a --save directory (its latest checkpoint) or one iter_* directory. Prints
the source and target with their layouts and how many tensors and bytes were written.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from megapipe.checkpointing.common import SavedLayout  # noqa: E402
from megapipe.checkpointing.convert import (export_hf_checkpoint, export_megatron_checkpoint,  # noqa: E402
                                            import_hf_checkpoint, import_megatron_checkpoint, reshard)
from megapipe.errors import ConfigError, reports_user_errors  # noqa: E402


def _layout_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--data-parallel-size", type=int, default=1)
    parser.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=1,
                        help="model chunks per pipeline rank (interleaved schedule)")
    parser.add_argument("--pipeline-placement", choices=("looped", "v"), default="looped",
                        help="where the chunks live: looped (interleaved) or v (zbv, v-half, v-min, dualpipev; v=2)")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("reshard", help="rewrite a checkpoint for another (t, p, d, v)")
    command.add_argument("source")
    command.add_argument("target")
    _layout_flags(command)
    command = commands.add_parser("import-hf", help="Hugging Face GPT-2/BERT/Llama/Mistral/Qwen2/Mixtral/Qwen2-MoE/"
                                  "Qwen3-MoE/OLMoE directory -> megapipe checkpoint")
    command.add_argument("hf_dir")
    command.add_argument("target")
    command.add_argument("--initialize-missing-heads", action="store_true",
                         help="a BERT encoder saved without pretraining heads (BertModel): start its masked-LM and "
                              "sentence-order heads from random weights")
    _layout_flags(command)
    command = commands.add_parser("export-hf", help="megapipe checkpoint -> Hugging Face directory")
    command.add_argument("source")
    command.add_argument("hf_dir")
    command.add_argument("--max-shard-size", default="5GB", help="larger models are written as indexed shards")
    command = commands.add_parser("import-megatron", help="Megatron-LM checkpoint (torch or torch_dist) -> megapipe "
                                  "checkpoint")
    command.add_argument("source", help="the Megatron save directory or one iter_* directory in it")
    command.add_argument("target")
    command.add_argument("--vocab-size", type=int, default=None,
                         help="the tokenizer's vocabulary size when the checkpoint's arguments keep only the padded "
                              "one (Megatron-LM's usual case); the embedding rows past it are padding")
    _layout_flags(command)
    command = commands.add_parser("export-megatron", help="megapipe checkpoint -> Megatron-core torch_dist checkpoint")
    command.add_argument("source")
    command.add_argument("target")
    return parser.parse_args(argv)


def _layout(args) -> SavedLayout:
    sizes = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.data_parallel_size,
             args.virtual_pipeline_model_parallel_size)
    if min(sizes) < 1:
        raise ConfigError(f"parallel sizes must be at least 1, got (t, p, d, v) = {sizes}.")
    if args.pipeline_placement == "v" and sizes[3] != 2:
        raise ConfigError(f"--pipeline-placement v holds two chunks per rank; set "
                          f"--virtual-pipeline-model-parallel-size 2, not {sizes[3]}.")
    return SavedLayout(*sizes, placement=args.pipeline_placement)


@reports_user_errors
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command == "reshard":
        done = reshard(args.source, args.target, _layout(args))
    elif args.command == "import-hf":
        done = import_hf_checkpoint(args.hf_dir, args.target, _layout(args), args.initialize_missing_heads)
    elif args.command == "import-megatron":
        done = import_megatron_checkpoint(args.source, args.target, _layout(args), args.vocab_size)
    elif args.command == "export-megatron":
        done = export_megatron_checkpoint(args.source, args.target)
    else:
        done = export_hf_checkpoint(args.source, args.hf_dir, args.max_shard_size)
    print("\n".join(done.lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
