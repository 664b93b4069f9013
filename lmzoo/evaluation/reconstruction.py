"""How well a denoising encoder-decoder (T5 span corruption, BART denoising) restores the original text.

`evaluate_reconstruction(run, state, split, num_examples=200, beam_size=1)` decodes the encoder input of
the split's evaluation examples (greedy, or beam search when beam_size > 1), turns each prediction into
the text it implies and scores it against the uncorrupted text:

    T5    the predicted sentinel spans are put back into the corrupted input
          (`noising.reconstruct_from_span_corruption`; any prediction gives a string)
    BART  the decoder output is the text itself

Both sides are detokenized by the run's tokenizer, documents (EOS-separated) joined by newlines.
Metrics: `bleu` (sacrebleu corpus BLEU), `rouge1` / `rouge2` / `rougeL` (rouge-score F-measures,
averaged over examples, no stemming), `exact_match` (fraction of identical texts) and
`target_token_accuracy` (teacher-forced top-1 accuracy of the decoder targets of the same examples,
through the run's eval step). For scale, `copy_*` are the text metrics of the corrupted input with its
sentinels / masks deleted, what a model that restores nothing would score (T5 keeps ~85% of the text
in place, so its BLEU is high even then).

An example is one evaluation window. Windows run across documents, so targets can hold an EOS before
their end; decoding therefore does not stop at EOS but writes the targets' full length, which every
training window has. The last, shorter window of a split (and the padding rows of its last batch)
are skipped.
"""

import jax
import numpy as np

from lmzoo import decoding, sharding, tokenizers
from lmzoo import metrics as metrics_lib
from lmzoo.data import noising


def reconstruct_tokens(
    objective: str, inputs: np.ndarray, prediction: np.ndarray, *, sentinel_ids, eos_id: int
) -> np.ndarray:
    """The original tokens a decoder output [T] implies for encoder input [S] (both without padding)."""
    if objective == "span_corruption":
        return noising.reconstruct_from_span_corruption(inputs, prediction, sentinel_ids, eos_id)
    return prediction[:-1] if len(prediction) and prediction[-1] == eos_id else prediction


def detokenize(tokenizer: tokenizers.Tokenizer, ids: np.ndarray) -> str:
    """Text of `ids`; EOS separates documents and becomes a newline."""
    ids = [int(i) for i in ids]
    documents, start = [], 0
    for end in [i for i, t in enumerate(ids) if t == tokenizer.eos_id] + [len(ids)]:
        documents.append(tokenizer.decode(ids[start:end]))
        start = end + 1
    return "\n".join(documents)


def text_metrics(hypotheses: list[str], references: list[str]) -> dict[str, float]:
    """Corpus BLEU (sacrebleu), mean ROUGE-1/2/L F-measures (rouge-score) and exact match of texts."""
    import sacrebleu
    from rouge_score import rouge_scorer

    if len(hypotheses) != len(references) or not references:
        raise ValueError(
            f"need equally many hypotheses and references, at least one; got {len(hypotheses)} and {len(references)}"
        )
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=False)
    scores = [scorer.score(ref, hyp) for hyp, ref in zip(hypotheses, references, strict=True)]
    return {
        "bleu": float(sacrebleu.corpus_bleu(hypotheses, [references]).score),
        **{name: float(np.mean([s[name].fmeasure for s in scores])) for name in ("rouge1", "rouge2", "rougeL")},
        "exact_match": float(np.mean([h == r for h, r in zip(hypotheses, references, strict=True)])),
    }


def _decode(run, params, inputs: np.ndarray, segments: np.ndarray, length: int, beam_size: int) -> np.ndarray:
    """Decoder outputs [N, length] for encoder inputs [N, S]: greedy, or the best of `beam_size` beams."""
    pad_id = run.tokenizer.pad_id or 0
    if beam_size > 1:
        # eos_id -1 matches no token: every hypothesis runs to `length` (targets may hold EOS mid-way).
        tokens, _ = decoding.beam_search(
            run.model,
            params,
            inputs,
            beam_size=beam_size,
            max_new_tokens=length,
            eos_id=-1,
            pad_id=pad_id,
            encoder_segment_ids=segments,
            vocab_size=run.tokenizer.vocab_size,
        )
    else:
        tokens = decoding.generate_seq2seq(
            run.model,
            params,
            inputs,
            rng=jax.random.key(0),
            max_new_tokens=length,
            encoder_segment_ids=segments,
            temperature=0.0,
            eos_id=None,
            pad_id=pad_id,
            vocab_size=run.tokenizer.vocab_size,
        )
    return np.asarray(tokens)


def evaluate_reconstruction(
    run, state, split: str = "validation", *, num_examples: int = 200, beam_size: int = 1
) -> tuple[dict[str, float], list[dict[str, str]]]:
    """(metrics, examples) over the first `num_examples` complete windows of `split`; see the module doc.

    Each example is {"corrupted", "reconstruction", "original"} text. Single process only.
    """
    tokenizer, objective = run.tokenizer, run.config.objective.name
    if num_examples < 1 or beam_size < 1:
        raise ValueError(f"num_examples and beam_size must be at least 1; got {num_examples} and {beam_size}")
    if jax.process_count() > 1:
        raise NotImplementedError("reconstruction metrics run in a single process; evaluate with one host")
    sentinel_ids = [tokenizer.sentinel_id(i) for i in range(getattr(tokenizer, "extra_ids", 0))]
    eos = tokenizer.eos_id
    params = run.compiled.host_params(state)
    markers = sentinel_ids + ([tokenizer.mask_id] if tokenizer.mask_id is not None else [])
    examples, copies, total = [], [], None
    for batch in run.eval_batches(split):
        if len(examples) >= num_examples:
            break
        width = batch["targets"].shape[1]
        keep = batch["weights"].sum(axis=1) == width
        keep &= np.cumsum(keep) <= num_examples - len(examples)
        if not keep.any():
            continue
        masked = {**batch, "weights": batch["weights"] * keep[:, None]}
        with run.context():
            step_metrics, _ = run.compiled.eval_step(state, sharding.put_batch(masked, run.compiled.batch_sharding), {})
        total = metrics_lib.accumulate(total, step_metrics)
        predictions = _decode(run, params, batch["inputs"][keep], batch["encoder_segment_ids"][keep], width, beam_size)
        rows = zip(
            batch["inputs"][keep], batch["encoder_segment_ids"][keep], batch["targets"][keep], predictions, strict=True
        )
        for inputs, segments, targets, prediction in rows:
            inputs = inputs[segments != 0]
            original = reconstruct_tokens(objective, inputs, targets, sentinel_ids=sentinel_ids, eos_id=eos)
            restored = reconstruct_tokens(objective, inputs, prediction, sentinel_ids=sentinel_ids, eos_id=eos)
            corrupted = inputs[:-1] if len(inputs) and inputs[-1] == eos else inputs
            examples.append(
                {
                    "corrupted": detokenize(tokenizer, corrupted),
                    "reconstruction": detokenize(tokenizer, restored),
                    "original": detokenize(tokenizer, original),
                }
            )
            copies.append(detokenize(tokenizer, corrupted[~np.isin(corrupted, markers)]))
    if not examples:
        raise ValueError(f"the {split} split has no complete evaluation window to reconstruct; use more data")
    references = [e["original"] for e in examples]
    result = {
        "reconstruct_examples": len(examples),
        "beam_size": beam_size,
        **text_metrics([e["reconstruction"] for e in examples], references),
    }
    result["target_token_accuracy"] = metrics_lib.summarize(total)["accuracy"]
    result.update({f"copy_{k}": v for k, v in text_metrics(copies, references).items()})
    return result, examples
