"""A GRPO step with a verifiable reward (rollout + reward + update) of lmzoo against trl's GRPOTrainer and tunix's
GRPOLearner: samples/s (completions per second) of each on the same model, prompts and shapes, in interleaved rounds
of the same run, with the rollout's share of each step and PASS/MISS against the target lmzoo >= 1.5x the faster peer.

    PYTHONPATH=$PWD venv-trl/bin/python bench/grpo_bench.py --tiny        # smoke run, about a minute
    PYTHONPATH=$PWD venv-trl/bin/python bench/grpo_bench.py               # the measured shape, 3 rounds
    PYTHONPATH=$PWD python bench/grpo_bench.py --peers tunix              # without trl (lmzoo's venv has none)

The peers' venvs (neither is a requirement of lmzoo):
    trl: python3 -m venv venv-trl && echo $VIRTUAL_ENV/lib/python3.11/site-packages > venv-trl/lib/python3.11/site-packages/lmzoo.pth
         venv-trl/bin/pip install trl==1.16.0            # (bench/ppo_bench.py); the bench runs under this python
    tunix: python3 -m venv venv-tunix && venv-tunix/bin/pip install google-tunix==0.1.7 jax==0.10.2 jaxlib==0.10.2
           (its own jax, flax 0.12.8, transformers 5.12; `--tunix_python`, default venv-tunix/bin/python, runs it in a
           process of its own that reads nothing of lmzoo but `lmzoo.rl.rewards`)
A peer that is missing or fails to start is reported with the reason and left out; lmzoo is always measured.

What is the same on each side:
- The model: a random Llama/Qwen2-shaped decoder (RMSNorm, rotary positions with base 1e6, grouped-query attention,
  SwiGLU, untied head; the byte vocabulary 256 + <eos> 256 + <pad> 257), initialised by lmzoo and exported with
  `lmzoo.convert.export.export_hf` (LlamaForCausalLM, float32) with `common.hf_byte_tokenizer`: trl loads that folder,
  tunix reads its safetensors into `tunix.models.llama3.Llama3` (`create_model_from_safe_tensors`). The three
  forwards agree to ~4e-7 on the same ids. (The rotary base is 1e6, Qwen2's, because tunix 0.1.7's Llama3 attention
  always rotates with its default base 1e6, whatever `ModelConfig.rope_theta` says.)
- The prompts: GSM8K training questions (../shared/data/gsm8k/train.jsonl) as configs/gsm8k.py renders them,
  "Question: ...\\nAnswer:", keeping the ASCII ones (so bytes are characters for the HF byte tokenizer) that fit
  prompt_len bytes, so no side truncates; batches drawn by each framework's own loader from that pool.
- The reward: `lmzoo.rl.rewards.gsm8k` (the reply's final number equals the one after the row's `####`), called by
  lmzoo's reward pool (config.objective.rewards="gsm8k"), by trl as `reward_funcs=[gsm8k_reward]` and by tunix as
  `reward_fns=[gsm8k_reward]` (both called with the batch's prompts, completions and `answer` column).
- The algorithm: GRPO as all three define it by default, without a KL term: G samples per prompt at temperature 1,
  advantages normalised by the group's mean and std, the clipped surrogate (eps 0.2 both sides), loss averaged over
  the batch's completion tokens (lmzoo loss_aggregation "token", trl loss_type "dapo", tunix loss_agg_mode
  "token-mean"), beta 0 (lmzoo kl_loss "off": none of them runs a reference model), one update per rollout (1 epoch x
  1 minibatch; trl steps_per_generation 1, num_iterations 1; tunix num_iterations 1), AdamW at lmzoo's
  learning rate, betas and eps, no weight decay, gradients clipped at lmzoo's norm, a constant learning rate.
- lmzoo's step is configs/gsm8k.py's GRPO recipe (its default variant) with that model and shape: what train.py
  runs, `lmzoo.train.run.build` -> `restore_or_init` -> the loader's batch -> the jitted phases (rollout: the KV-cache
  sampler prefilling each prompt once for its G samples; scoring: the reward pool on the decoded replies and the
  policy's log-probs; update) through `lmzoo.train.loop.run_timed_phases`, which also gives the rollout's time.

Timing: each framework runs in a process of its own (lmzoo and trl: `common.Isolated`; tunix: its venv's python),
builds once, warms up (2 steps: the first compiles), then each round runs `steps` GRPO steps of each framework in
turn (`common.round_order`). A step is timed from the start of one step to the start of the next (lmzoo: the loop's
batch fetch + the three phases; trl: on_step_begin to on_step_begin, the `Trainer` loop itself; tunix: one pull of
its training iterator to the next, its `train` loop itself), so everything a user's run spends per step counts.
The rollout is lmzoo's rollout phase, trl's `transformers.generate` (its profiling hook) and tunix's
`RLCluster.generate`. torch runs each round's steps on 1 and then on 2 threads (in turn first) and keeps the faster,
as bench/finetune_bench.py does (torch's 2 OpenMP threads collapse when another process takes a core; XLA's do not).
The matmul peak and the load are measured in each round. Samples/s = prompts x G x steps / their seconds.
"""

import argparse
import dataclasses
import json
import os
import pathlib
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GSM8K_TRAIN = ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
PROMPT_TEMPLATE = "Question: {question}\nAnswer:"  # configs/gsm8k.py's
VOCAB_SIZE = 258  # lmzoo's byte tokenizer: 256 bytes, <eos> 256, <pad> 257
ROPE_THETA = 1_000_000.0  # tunix 0.1.7's Llama3 rotates with 1e6 whatever its config says (see the docstring)
TARGET = 1.5  # lmzoo's samples/s over the faster peer's
WARMUP_STEPS = 2
QUIET_LOAD = 1.5  # the load average at start above which a run is not one for RESULTS
PEERS = ("trl", "tunix")


@dataclasses.dataclass(frozen=True)
class Spec:
    """The model and the GRPO step's shape: `prompts` prompts x `samples_per_prompt` (G) completions of up to
    `response_len` tokens after prompts of at most `prompt_len` tokens."""

    emb_dim: int
    num_heads: int
    num_kv_heads: int
    num_layers: int
    mlp_dim: int
    prompts: int
    samples_per_prompt: int
    prompt_len: int
    response_len: int
    steps_per_round: int
    rounds: int

    @property
    def samples(self) -> int:
        return self.prompts * self.samples_per_prompt

    @property
    def head_dim(self) -> int:
        return self.emb_dim // self.num_heads

    def describe(self) -> str:
        return (
            f"Llama/Qwen2-shaped D{self.emb_dim} x {self.num_layers} layers, {self.num_heads} heads / "
            f"{self.num_kv_heads} kv heads of {self.head_dim}, SwiGLU {self.mlp_dim}, vocab {VOCAB_SIZE}; "
            f"{self.prompts} prompts x G={self.samples_per_prompt} = {self.samples} samples/step, prompts <= "
            f"{self.prompt_len} tokens, replies <= {self.response_len} tokens"
        )


# The measured shape: configs/gsm8k.py's CPU-sized model (its `addition` variants': D 128, 2 layers, 4 heads, 512)
# Llama-shaped, on GSM8K prompts. --tiny: configs/gsm8k.py:tiny's model, a smoke run.
FULL = Spec(
    128, 4, 2, 2, 512, prompts=8, samples_per_prompt=8, prompt_len=128, response_len=64, steps_per_round=3, rounds=3
)
TINY = Spec(
    32, 2, 1, 1, 64, prompts=4, samples_per_prompt=4, prompt_len=128, response_len=16, steps_per_round=2, rounds=1
)


def problems(prompt_len: int) -> list[dict]:
    """GSM8K training rows whose prompt is ASCII and at most `prompt_len` bytes."""
    rows = [json.loads(line) for line in GSM8K_TRAIN.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["question"].isascii() and len(PROMPT_TEMPLATE.format(**r).encode()) <= prompt_len]


def gsm8k_reward(prompts, completions, answer, **_) -> list[float]:
    """lmzoo's built-in "gsm8k" reward in trl's and tunix's batched form."""
    from lmzoo.rl import rewards

    return [rewards.gsm8k(completion, a) for completion, a in zip(completions, answer, strict=True)]


# --- lmzoo ------------------------------------------------------------------------------------------------------


def lmzoo_config(spec: Spec, data_path: str):
    """configs/gsm8k.py's GRPO recipe on `spec`'s Llama and shape, plain GRPO (see the module docstring)."""
    from lmzoo import config as config_lib

    config = config_lib.load_config_file(ROOT / "configs" / "gsm8k.py")
    config.model_name = "llama"
    config.model = config_lib.model_section(
        "llama",
        vocab_size=VOCAB_SIZE,
        max_len=spec.prompt_len + spec.response_len,
        emb_dim=spec.emb_dim,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        num_layers=spec.num_layers,
        mlp_dim=spec.mlp_dim,
        rope_theta=ROPE_THETA,
    )
    config.data.path = data_path
    config.data.seq_len = spec.prompt_len + spec.response_len
    config.objective.update(
        prompt_len=spec.prompt_len,
        response_len=spec.response_len,
        samples_per_prompt=spec.samples_per_prompt,
        scale_rewards=True,  # GRPO's group std (the recipe's Dr. GRPO drops it; the peers' defaults keep it)
        clip_eps_high=0.0,  # symmetric clip (the recipe's DAPO clip-higher is not tunix GRPO's)
        loss_aggregation="token",
        kl_loss="off",
        kl_coef=0.0,
    )
    config.train.batch_size = spec.prompts
    config.optim.warmup_steps = 0  # with min_learning_rate = learning_rate: constant, as the peers run
    return config


class LmzooGRPO:
    """lmzoo's GRPO step as train.py runs it (in a process set up as train.py's: `common.Isolated`)."""

    def __init__(self, spec: Spec, data_path: str, hf_dir: str):
        from bench import common
        from lmzoo.convert import export
        from lmzoo.train import run as run_lib

        config = lmzoo_config(spec, data_path)
        self.spec = spec
        self.run_ = run_lib.build(config, str(pathlib.Path(hf_dir).parent / "lmzoo_run"))
        self.state, _ = run_lib.restore_or_init(self.run_)
        self.loader = self.run_.train_loader()
        self.step = 0
        self.config = config
        params = self.run_.compiled.host_params(self.state)["decoder"]  # the policy every framework starts from
        export.export_hf("llama", config.model, params, hf_dir, self.run_.tokenizer, overwrite=True)
        common.hf_byte_tokenizer().save_pretrained(hf_dir)

    def run(self, request: dict) -> list[dict]:
        from lmzoo import sharding
        from lmzoo.train import loop

        compiled, rows = self.run_.compiled, []
        for _ in range(request["steps"]):
            began = time.perf_counter()
            batch = sharding.put_batch(self.loader.batch(self.step), compiled.batch_sharding)
            with self.run_.context():
                self.state, metrics = loop.run_timed_phases(compiled.phases, self.state, batch)
            reward_sum, count = (float(v) for v in metrics["rewards/gsm8k"])
            rows.append(
                {
                    "step_s": time.perf_counter() - began,
                    **{f"{phase}_s": float(metrics[f"time/{phase}_ms"][0]) / 1e3 for phase in compiled.phases},
                    "reward_sum": reward_sum,
                    "reward_count": count,
                }
            )
            self.step += 1
        return rows


def build_lmzoo(spec: Spec, data_path: str, hf_dir: str) -> LmzooGRPO:
    return LmzooGRPO(spec, data_path, hf_dir)


def optim_settings(spec: Spec, data_path: str) -> dict:
    """The optimizer lmzoo's recipe runs, for the peers."""
    o = lmzoo_config(spec, data_path).optim
    return dict(lr=o.learning_rate, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, grad_clip=o.grad_clip)


# --- a peer's training loop, driven step by step ------------------------------------------------------------------


class SteppedLoop:
    """Runs a framework's own training loop (`loop()`, which never ends by itself) in a thread (`start`), released a
    number of steps at a time: the loop calls `boundary()` at the start of each step, which blocks until `run` releases
    steps (calling `on_release(request)` first) and times each step from one boundary to the next. `note(**values)`
    adds to the running step's row."""

    def __init__(self, loop, on_release=None):
        self._requests, self._results = queue.Queue(), queue.Queue()
        self._budget, self._began, self._rows, self._row = 0, None, [], {}
        self._loop, self._on_release = loop, on_release

    def start(self) -> None:
        threading.Thread(target=self._main, args=(self._loop,), daemon=True).start()

    def _main(self, loop) -> None:
        try:
            loop()
            self._results.put(("error", "the training loop ended"))
        except BaseException:
            self._results.put(("error", traceback.format_exc()))

    def note(self, **values) -> None:
        for key, value in values.items():
            self._row[key] = self._row.get(key, 0.0) + value

    def boundary(self) -> None:
        now = time.perf_counter()
        if self._began is not None:
            self._rows.append({"step_s": now - self._began, **self._row})
        if self._budget == 0:
            if self._began is not None:
                self._results.put(("ok", self._rows))
            request = self._requests.get()
            if self._on_release is not None:
                self._on_release(request)
            self._budget, self._rows = request["steps"], []
            now = time.perf_counter()
        self._budget -= 1
        self._began, self._row = now, {}

    def run(self, request: dict) -> list[dict]:
        self._requests.put(request)
        status, value = self._results.get()
        if status == "error":
            raise RuntimeError(value)
        return value


# --- trl ----------------------------------------------------------------------------------------------------------


class TrlGRPO:
    """trl's GRPOTrainer with `gsm8k_reward` on the exported policy, its `train()` driven by `SteppedLoop`; each
    request's `threads` sets torch's thread count first."""

    def __init__(self, spec: Spec, data_path: str, hf_dir: str):
        import datasets
        import torch
        import transformers
        import trl
        from trl.extras import profiling

        from bench import common

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        datasets.disable_progress_bars()
        warnings.filterwarnings("ignore", category=FutureWarning)  # transformers 5's gradient_checkpointing renames
        torch.manual_seed(0)
        optim = optim_settings(spec, data_path)
        rows = [json.loads(line) for line in pathlib.Path(data_path).read_text().splitlines()]
        dataset = datasets.Dataset.from_dict(
            {"prompt": [PROMPT_TEMPLATE.format(**r) for r in rows], "answer": [r["answer"] for r in rows]}
        )
        args = trl.GRPOConfig(
            output_dir=str(pathlib.Path(hf_dir).parent / "trl_run"),
            **common.TRL_ON_CPU,
            per_device_train_batch_size=spec.samples,
            num_generations=spec.samples_per_prompt,
            steps_per_generation=1,
            num_iterations=1,
            max_completion_length=spec.response_len,
            temperature=1.0,
            beta=0.0,
            epsilon=0.2,
            scale_rewards="group",
            loss_type="dapo",  # the token mean over the batch
            learning_rate=optim["lr"],
            adam_beta1=optim["b1"],
            adam_beta2=optim["b2"],
            adam_epsilon=optim["eps"],
            weight_decay=optim["weight_decay"],
            max_grad_norm=optim["grad_clip"],
            lr_scheduler_type="constant",
            max_steps=10**9,
            seed=0,
            dataloader_num_workers=0,
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)

        def reward(prompts, completions, answer, **_):
            values = gsm8k_reward(prompts, completions, answer)
            stepped.note(reward_sum=sum(values), reward_count=len(values))
            return values

        reward.__name__ = gsm8k_reward.__name__
        trainer = trl.GRPOTrainer(
            model=hf_dir,
            reward_funcs=[reward],
            args=args,
            processing_class=tokenizer,
            train_dataset=dataset,
        )
        stepped = SteppedLoop(
            trainer.train, on_release=lambda request: torch.set_num_threads(request.get("threads") or os.cpu_count())
        )
        self.stepped = stepped

        def record(context, duration):
            if context.name.endswith(".transformers.generate"):
                stepped.note(rollout_s=duration)

        class Boundaries(transformers.TrainerCallback):
            def on_step_begin(self, *args, **kwargs):
                stepped.boundary()

        profiling.ProfilingContext._log_metrics = record
        trainer.add_callback(Boundaries())
        stepped.start()

    def run(self, request: dict) -> list[dict]:
        return self.stepped.run(request)


def build_trl(spec: Spec, data_path: str, hf_dir: str) -> TrlGRPO:
    return TrlGRPO(spec, data_path, hf_dir)


# --- tunix (in its own venv) ----------------------------------------------------------------------------------------


class TunixGRPO:
    """tunix's GRPOLearner (vanilla rollout engine, actor = rollout = one CPU mesh, no reference) with
    `gsm8k_reward` on the exported policy, its `train()` driven by `SteppedLoop` through its training iterator."""

    def __init__(self, spec: Spec, data_path: str, hf_dir: str, optim: dict):
        import jax
        import jax.numpy as jnp
        import optax
        import transformers
        from tunix.models.llama3 import model as llama_lib
        from tunix.models.llama3 import params as llama_params
        from tunix.rl import rl_cluster as rl_lib
        from tunix.rl.grpo import grpo_learner
        from tunix.rl.rollout import base_rollout

        model_config = llama_lib.ModelConfig(
            num_layers=spec.num_layers,
            vocab_size=VOCAB_SIZE,
            embed_dim=spec.emb_dim,
            hidden_dim=spec.mlp_dim,
            num_heads=spec.num_heads,
            head_dim=spec.head_dim,
            num_kv_heads=spec.num_kv_heads,
            rope_theta=int(ROPE_THETA),
            norm_eps=1e-6,
        )
        mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
        model = llama_params.create_model_from_safe_tensors(hf_dir, model_config, mesh=mesh, dtype=jnp.float32)
        optimizer = optax.chain(
            optax.clip_by_global_norm(optim["grad_clip"]),
            optax.adamw(optim["lr"], optim["b1"], optim["b2"], optim["eps"], weight_decay=optim["weight_decay"]),
        )
        cluster = rl_lib.RLCluster(
            actor=model,
            reference=None,
            tokenizer=transformers.AutoTokenizer.from_pretrained(hf_dir),
            cluster_config=rl_lib.ClusterConfig(
                role_to_mesh={role: mesh for role in (rl_lib.Role.ACTOR, rl_lib.Role.REFERENCE, rl_lib.Role.ROLLOUT)},
                rollout_engine="vanilla",
                offload_to_cpu=False,
                training_config=rl_lib.RLTrainingConfig(
                    actor_optimizer=optimizer, eval_every_n_steps=10**9, max_steps=10**9
                ),
                rollout_config=base_rollout.RolloutConfig(
                    max_tokens_to_generate=spec.response_len,
                    max_prompt_length=spec.prompt_len,
                    kv_cache_size=spec.prompt_len + spec.response_len,
                    temperature=1.0,
                    top_p=1.0,
                    top_k=None,
                ),
            ),
        )
        config = grpo_learner.GRPOConfig(
            num_generations=spec.samples_per_prompt, num_iterations=1, beta=0.0, epsilon=0.2, loss_agg_mode="token-mean"
        )

        def reward(prompts, completions, answer, **_):
            values = gsm8k_reward(prompts, completions, answer)
            self.stepped.note(reward_sum=sum(values), reward_count=len(values))
            return values

        learner = grpo_learner.GRPOLearner(cluster, config, reward_fns=[reward])
        generate = cluster.generate

        def timed_generate(*args, **kwargs):
            began = time.perf_counter()
            output = generate(*args, **kwargs)
            self.stepped.note(rollout_s=time.perf_counter() - began)
            return output

        cluster.generate = timed_generate
        rows = [json.loads(line) for line in pathlib.Path(data_path).read_text().splitlines()]
        order = np.random.default_rng(0).permutation(len(rows))

        def batches():
            for step in range(10**9):
                self.stepped.boundary()
                start = step * spec.prompts % (len(rows) - spec.prompts)
                batch = [rows[i] for i in order[start : start + spec.prompts]]
                yield {
                    "prompts": np.array([PROMPT_TEMPLATE.format(**r) for r in batch]),
                    "answer": np.array([r["answer"] for r in batch]),
                }

        self.stepped = SteppedLoop(lambda: learner.train(batches()))
        self.stepped.start()

    def run(self, request: dict) -> list[dict]:
        return self.stepped.run(request)


def tunix_worker(argument: str) -> None:
    """The tunix process (`TunixProcess`): one JSON line in (a request, or null to end) -> one JSON line out on the
    protocol pipe (the original stdout; everything else the libraries print goes to stderr)."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    try:
        options = json.loads(argument)
        trainer = TunixGRPO(Spec(**options["spec"]), options["data_path"], options["hf_dir"], options["optim"])
        from importlib import metadata

        protocol.write(json.dumps({"ok": metadata.version("google-tunix")}) + "\n")
    except Exception:
        protocol.write(json.dumps({"error": traceback.format_exc()}) + "\n")
        return
    for line in sys.stdin:
        request = json.loads(line)
        if request is None:
            return
        try:
            protocol.write(json.dumps({"ok": trainer.run(request)}) + "\n")
        except Exception:
            protocol.write(json.dumps({"error": traceback.format_exc()}) + "\n")
            return


class TunixProcess:
    """`TunixGRPO` in tunix's venv (`tunix_worker`), with `common.Isolated`'s start / finish / run / close."""

    def __init__(self, python: str, spec: Spec, data_path: str, hf_dir: str, optim: dict):
        self._log = open(pathlib.Path(hf_dir).parent / "tunix_worker.log", "w+")  # noqa: SIM115  (kept open)
        options = {"spec": dataclasses.asdict(spec), "data_path": data_path, "hf_dir": hf_dir, "optim": optim}
        env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
        self._process = subprocess.Popen(
            [python, str(pathlib.Path(__file__).resolve()), "--tunix_worker", json.dumps(options)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )

    def ready(self) -> str:
        """Waits for the worker to have built the learner; its tunix version."""
        return self._receive()

    def _receive(self):
        line = self._process.stdout.readline()
        if not line:
            self._process.wait()
            raise RuntimeError(f"the tunix process died (exit code {self._process.returncode}):\n{self.log_tail()}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"the tunix process failed:\n{reply['error']}")
        return reply["ok"]

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(pathlib.Path(self._log.name).read_text(errors="replace").splitlines()[-lines:])

    def start(self, request: dict) -> None:
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()

    def finish(self):
        return self._receive()

    def run(self, request: dict):
        self.start(request)
        return self.finish()

    def close(self) -> None:
        try:
            self._process.stdin.write("null\n")
            self._process.stdin.close()
            self._process.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self._process.kill()


# --- the bench ------------------------------------------------------------------------------------------------------


def start_peers(peers: list[str], spec: Spec, data_path: str, hf_dir: str, tunix_python: str) -> dict:
    """The peers that start, each in a process of its own; a peer that cannot is reported and left out."""
    from bench import common

    def not_measured(name: str, error: Exception) -> None:
        reason = str(error) if isinstance(error, RuntimeError) else f"{type(error).__name__}: {error}"
        print(f"{name}: not measured: {reason.strip()[-3000:]}", flush=True)

    started, tunix = {}, None
    if "tunix" in peers:  # its process builds while trl's does
        if pathlib.Path(tunix_python).exists():
            tunix = TunixProcess(tunix_python, spec, data_path, hf_dir, optim_settings(spec, data_path))
        else:
            not_measured("tunix", RuntimeError(f"{tunix_python} does not exist: make tunix's venv (see {__file__})"))
    if "trl" in peers:
        try:
            import trl

            started[f"trl {trl.__version__}"] = common.Isolated(build_trl, spec, data_path, hf_dir)
        except Exception as error:  # noqa: BLE001  (any failure of a peer is reported, the bench goes on)
            not_measured("trl", error)
    if tunix is not None:
        try:
            started[f"tunix {tunix.ready()}"] = tunix
        except Exception as error:  # noqa: BLE001
            tunix.close()
            not_measured("tunix", error)
    return started


def summed(rows: list[dict], key: str) -> float:
    return float(sum(row.get(key, 0.0) for row in rows))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="configs/gsm8k.py:tiny's model, 1 round: about a minute")
    parser.add_argument("--rounds", type=int, default=None, help="default 3 (--tiny: 1)")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps per framework per round (default 3; 2)")
    parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated, of trl,tunix ('' = lmzoo only)")
    parser.add_argument("--tunix_python", default=str(ROOT / "venv-tunix" / "bin" / "python"))
    parser.add_argument("--tunix_worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tunix_worker:
        return tunix_worker(args.tunix_worker)
    peers = [p for p in args.peers.split(",") if p]
    if set(peers) - set(PEERS):
        parser.error(f"--peers {args.peers!r}: choose from {PEERS}")
    spec = TINY if args.tiny else FULL
    spec = dataclasses.replace(
        spec, rounds=args.rounds or spec.rounds, steps_per_round=args.steps or spec.steps_per_round
    )

    from bench import common

    load = common.announce("grpo", "tiny" if args.tiny else "full", spec.describe(), spec.rounds)
    common.print_matmul_peak()
    rows = problems(spec.prompt_len)
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="grpo_bench_"))
    data_path, hf_dir = str(workdir / "problems.jsonl"), str(workdir / "policy")
    pathlib.Path(data_path).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(
        f"prompts: {len(rows)} GSM8K training questions (ASCII, <= {spec.prompt_len} bytes rendered); reward: "
        f"lmzoo.rl.rewards.gsm8k; {spec.steps_per_round} steps per framework per round after {WARMUP_STEPS} warm-up "
        "steps",
        flush=True,
    )
    built = time.perf_counter()
    frameworks = {
        "lmzoo": common.Isolated(build_lmzoo, spec, data_path, hf_dir, daemon=False)
    }  # exports the policy first
    frameworks |= start_peers(peers, spec, data_path, hf_dir, args.tunix_python)
    print(f"built in {time.perf_counter() - built:.1f} s: {', '.join(frameworks)}", flush=True)
    is_torch = {name: name.startswith("trl") for name in frameworks}
    warm = time.perf_counter()
    for trainer in frameworks.values():  # side by side: each compiles in its own process
        trainer.start({"steps": WARMUP_STEPS})
    first = {name: trainer.finish() for name, trainer in frameworks.items()}
    print(
        f"warm-up ({WARMUP_STEPS} steps each, side by side) {time.perf_counter() - warm:.1f} s; first step s: "
        + ", ".join(f"{name} {rows_[0]['step_s']:.1f}" for name, rows_ in first.items()),
        flush=True,
    )

    detail = {name: [] for name in frameworks}  # every timed step's row, for the breakdown
    threads = {name: [] for name in frameworks}

    def measure(r: int) -> dict[str, float]:
        row = {}
        for name in common.round_order(list(frameworks), r):
            trainer = frameworks[name]
            if is_torch[name]:  # 1 and 2 threads, in turn first; the faster kept
                counts = (1, 2) if r % 2 == 0 else (2, 1)
                runs = {t: trainer.run({"steps": spec.steps_per_round, "threads": t}) for t in counts}
                best = min(runs, key=lambda t: summed(runs[t], "step_s"))
                threads[name].append(best)
                steps = runs[best]
            else:
                steps = trainer.run({"steps": spec.steps_per_round})
            detail[name].extend(steps)
            row[name] = spec.samples * len(steps) / summed(steps, "step_s")
        peer_names = [name for name in frameworks if name != "lmzoo"]
        if peer_names:
            row["ratio"] = row["lmzoo"] / max(row[name] for name in peer_names)
        row["peak_gflops"] = max(common.matmul_peak(repeats=3).values())
        row["load"] = os.getloadavg()[0]
        return row

    per_round = common.measure_rounds("round", spec.rounds, measure)
    for trainer in frameworks.values():
        trainer.close()
    shutil.rmtree(workdir, ignore_errors=True)
    result = common.summary(per_round)
    load["end"] = os.getloadavg()[0]

    print(
        f"\nsamples/s (completions per second; {spec.samples} a step); load average at start {load['start']:.2f}, at end "
        f"{load['end']:.2f} (the rounds' and the end's include this bench's own busy process, about 2)"
    )
    columns = [(f"{name} samp/s", name, "{:.1f}") for name in frameworks]
    if "median_ratio" in result:
        columns.append(("lmzoo/faster peer", "ratio", "{:.2f}"))
    columns += [("peak GFLOP/s", "peak_gflops", "{:.1f}"), ("load", "load", "{:.2f}")]
    common.print_table(result, columns)

    print("\nper step (medians over the timed steps):")
    print(f"{'framework':>18} {'step ms':>9} {'rollout ms':>11} {'rollout share':>14} {'reward':>8}  torch threads")
    for name, steps in detail.items():
        step_ms = 1e3 * common.median(row["step_s"] for row in steps)
        rollout_ms = 1e3 * common.median(row.get("rollout_s", 0.0) for row in steps)
        share = summed(steps, "rollout_s") / summed(steps, "step_s")
        reward = summed(steps, "reward_sum") / max(summed(steps, "reward_count"), 1.0)
        chosen = ",".join(str(t) for t in threads[name]) if is_torch[name] else "-"
        print(f"{name:>18} {step_ms:9.1f} {rollout_ms:11.1f} {share:14.1%} {reward:8.3f}  {chosen}")
    lmzoo_share = summed(detail["lmzoo"], "rollout_s") / summed(detail["lmzoo"], "step_s")
    phases = ", ".join(
        f"{phase} {1e3 * common.median(row[f'{phase}_s'] for row in detail['lmzoo']):.1f}"
        for phase in ("rollout", "scoring", "update")
    )
    print(f"lmzoo's rollout share of its step: {lmzoo_share:.1%}; its phases (median ms): {phases}")

    if load["start"] > QUIET_LOAD:
        print(
            f"WARNING: load average {load['start']:.2f} > {QUIET_LOAD} at start: other processes shared the cores; "
            "a noisy row, not one for RESULTS (rerun on a quiet machine)"
        )
    if "median_ratio" not in result:
        print("no peer measured: no verdict")
        return
    faster = max((name for name in frameworks if name != "lmzoo"), key=lambda n: result[f"median_{n}"])
    print(f"\ntarget: lmzoo >= {TARGET}x the faster peer's samples/s (median over rounds of each round's ratio)")
    common.report_targets({f"lmzoo / {faster}": result["median_ratio"]}, {f"lmzoo / {faster}": TARGET})


if __name__ == "__main__":
    main()
