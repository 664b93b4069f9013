"""GPT-2 small (124M) pretraining on a prepared token store, with nanoGPT's OpenWebText settings.

Tokenize the corpus once (on storage every host sees), then train from the store:

    python -m lmzoo.data.prepare --source=/data/openwebtext --text_field=text --out=/data/stores/owt_gpt2 \\
        --tokenizer=gpt2 --tokenizer_path=../shared/data/tokenizers/gpt2 --validation_fraction=0.0005
    python train.py --config=configs/gpt2_124m.py --config.data.path=/data/stores/owt_gpt2 --workdir=runs/gpt2_124m

One optimizer step reads 480 sequences x 1,024 tokens = 491,520 tokens (nanoGPT: 12 x 1,024 x 40 accumulation steps): 40
microbatches of 12 on one device. On a host of 8 devices keep the step and pass --config.train.grad_accum_steps=5
(microbatches of 96, 12 per device), as nanoGPT's 8-GPU run does. AdamW (0.9, 0.95), lr 6e-4 cosine to 6e-5 over 600k
steps after 2k warmup, weight decay 0.1, clip 1.0, no dropout, bf16 compute with f32 parameters, the 12 layers scanned
(one layer traced and compiled, not twelve) and rematerialised as the platform needs (`remat_policy="auto"`: none on the
CPU, the projections kept on accelerators). The vocabulary is padded to 50,304 (a multiple of 64) as nanoGPT does; the
padded ids are never sampled. docs/SCALING.md has the multi-host commands.

Variant `tiny`: the same recipe at toy size, for a test on CPU from a small store.
"""

from lmzoo.config import base_config, check_variants, model_section


def get_config(arg: str | None = None):
    tiny = "tiny" in check_variants(arg, known=("tiny",))
    c = base_config()
    c.model_name = "gpt2"
    c.model = model_section(
        "gpt2",
        vocab_size=50304,
        max_len=1024,
        emb_dim=768,
        num_heads=12,
        num_layers=12,
        mlp_dim=3072,
        dropout_rate=0.0,
        attention_dropout_rate=0.0,
        dtype="bfloat16",
        scan_layers=True,
        remat_policy="auto",
    )
    c.data.source = "store"
    c.data.path = ""  # the store folder: --config.data.path=/data/stores/owt_gpt2
    c.data.seq_len = 1024
    c.train.batch_size = 480
    c.train.grad_accum_steps = 40
    c.train.steps = 600_000
    c.train.log_every = 10
    c.train.eval_every = 2000
    c.train.checkpoint_every = 1000
    c.train.keep_checkpoints = 3
    c.eval.batch_size = 48
    c.eval.max_batches = 50
    c.optim.learning_rate = 6e-4
    c.optim.min_learning_rate = 6e-5
    c.optim.warmup_steps = 2000
    c.optim.decay_steps = 600_000
    c.optim.b1, c.optim.b2 = 0.9, 0.95
    c.optim.weight_decay = 0.1
    c.optim.grad_clip = 1.0
    c.train.sample_prompt = "\n"
    if tiny:
        # One layer, looped: a scan of it traces and compiles slower on the CPU and steps no faster (issue 54).
        c.model.update(
            num_layers=1, emb_dim=32, num_heads=2, mlp_dim=64, max_len=64, dtype="float32", scan_layers=False
        )
        c.data.seq_len = 64
        c.train.batch_size, c.train.grad_accum_steps, c.train.steps = 8, 2, 3
        c.train.log_every = c.train.eval_every = c.train.checkpoint_every = 3
        c.eval.batch_size, c.eval.max_batches = 8, 2
        c.optim.warmup_steps, c.optim.decay_steps = 1, 3
        c.train.sample_tokens = 8
    return c
