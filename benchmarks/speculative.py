"""Speculative decoding (--speculative ngram|draft) against plain decoding, in one process, CPU or GPU (issue 29).

The device's StepExecutor driven by a scheduling core on this thread (as benchmarks/executor_decode.py
does: no Trio, no HTTP), each workload run with speculation off and in each mode of ``--modes``, one
after the other, greedy:

  edit       a ~2k-token source file in the prompt, asked back with one name changed (a capable model
             copies most of it; SmolLM2-135M writes a file of its own instead)
  copy       the same file asked back unchanged, the reply's first line given: SmolLM2 copies it with
             slips, the case prompt lookup is for
  repeat     random weights' own repetition: a prompt of a repeated pattern (random weights soon repeat
             a token; proposals come from the reply itself)
  fresh      a short prompt asking for new text (a story): little to look up; what speculation costs
             rows without proposals, which must stay >= 0.97x

at 1 and 8 streams (``--streams``). Per run: decode tokens/s (tokens of steps that prefilled nothing,
over those steps' wall time), verify steps, proposed and accepted tokens; per mode: the speed ratio
against off and whether every reply's tokens are identical to off's (they must be). ``draft`` needs
``--draft-model`` (the model itself: every proposal holds, the upper bound of acceptance, and the
mechanism's full cost: a draft as expensive as the target).

usage:
  python benchmarks/speculative.py --model-path ~/.cache/mlxcel/models/smollm2-f32-gguf-v1 \
      [--workloads edit,copy,fresh] [--streams 1,8] [--reply-tokens 256] [--tokens K] \
      [--modes ngram,draft --draft-model PATH] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

# This checkout's mlxcel, whatever the working directory.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class _Clients:
    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}

    def send(self, request_id: str, delta: Any) -> bool:
        self.tokens.setdefault(request_id, []).extend(delta.token_ids)
        return True

    def fail(self, request_id: str, error: Any) -> None:
        raise RuntimeError(getattr(error, "message", str(error)))

    def close(self, request_id: str) -> None:
        pass


def source_file(lines: int, seed: int) -> str:
    """A plausible Python module of about ``lines`` lines (deterministic)."""
    rng = random.Random(seed)
    names = ["total", "count", "items", "value", "result", "index", "buffer", "offset", "limit", "name"]
    out = []
    for number in range(lines // 6):
        a, b, c = rng.sample(names, 3)
        out += [f"def compute_{a}_{number}({b}, {c}):",
                f"    \"\"\"Return the {a} of {b} and {c}.\"\"\"",
                f"    {a} = {b} + {c} * {number}",
                f"    if {a} > {rng.randint(10, 999)}:",
                f"        return {a} - {c}",
                f"    return {a}", ""]
    return "\n".join(out)


def chat(tokenizer: Any, text: str, reply_start: str = "") -> tuple[int, ...]:
    # SmolLM2's (ChatML) turn markers; on random weights any tokens do.
    prompt = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n{reply_start}"
    return tuple(tokenizer.encode(prompt, add_special_tokens=False))


def workload_prompts(name: str, tokenizer: Any, streams: int, file_lines: int = 330) -> list[tuple[int, ...]]:
    prompts = []
    for index in range(streams):
        if name == "edit":
            code = source_file(file_lines, seed=index)
            text = ("Here is a Python file.\n\n```python\n" + code + "\n```\n\nRewrite the whole file, unchanged "
                    "except that the variable `total` is renamed to `amount`. Reply with the file only.")
            prompts.append(chat(tokenizer, text))
        elif name == "copy":
            # SmolLM2-135M asked for an edit writes a file of its own (the edit workload's replies share
            # little with the prompt); asked to repeat the file, with the reply's first line given, it
            # copies it with small slips (numbers, names): the copy-with-changes an edit is.
            code = source_file(file_lines, seed=index)
            text = ("Here is a Python file.\n\n```python\n" + code + "\n```\n\nRepeat the file exactly, "
                    "from its first line.")
            prompts.append(chat(tokenizer, text, reply_start="```python\n"))
        elif name == "repeat":
            pattern = [5 + index, 17, 99, 230, 41, 7, 300, 12]
            prompts.append(tuple(pattern * 40))
        elif name == "fresh":
            topics = ["a lighthouse keeper", "a lost dog", "a city under the sea", "a robot gardener",
                      "a winter market", "a desert train", "a clockmaker", "a mountain school"]
            prompts.append(chat(tokenizer, f"Write a long, imaginative story about {topics[index % len(topics)]}."))
        else:
            raise SystemExit(f"unknown workload {name!r}")
    return prompts


def run(loaded: Any, model_path: Path, prompts: list[tuple[int, ...]], *, speculative: str, tokens: int,
        reply_tokens: int, step_size: int, draft: Any = None) -> dict[str, Any]:
    """One workload under ``speculative`` (off, ngram, draft; "-open": the gate held open, as before it)."""
    from mlxcel.core.speculation_gate import SpeculationGate

    if not speculative.endswith("-open"):
        return _run(loaded, model_path, prompts, speculative=speculative, tokens=tokens,
                    reply_tokens=reply_tokens, step_size=step_size, draft=draft)
    measured = SpeculationGate.should_verify
    SpeculationGate.should_verify = lambda gate, batch_size: True  # type: ignore[method-assign]
    try:
        result = _run(loaded, model_path, prompts, speculative=speculative.removesuffix("-open"), tokens=tokens,
                      reply_tokens=reply_tokens, step_size=step_size, draft=draft)
    finally:
        SpeculationGate.should_verify = measured  # type: ignore[method-assign]
    return {**result, "speculative": speculative}


def _run(loaded: Any, model_path: Path, prompts: list[tuple[int, ...]], *, speculative: str, tokens: int,
         reply_tokens: int, step_size: int, draft: Any = None) -> dict[str, Any]:
    from mlxcel.core.plan import Capabilities
    from mlxcel.core.scheduler import NewRequest, SchedulerCore
    from mlxcel.model.executor import DeviceSettings, StepExecutor
    from mlxcel.types import SamplingParams

    settings = DeviceSettings(model_path=model_path, context_size=8192, prefill_step_size=step_size,
                              max_batch_size=max(8, len(prompts)), speculative=speculative,
                              speculative_tokens=tokens)
    executor = StepExecutor(loaded.model, loaded.eos_token_ids, settings, loaded.family.model_type,
                            tokenizer=loaded.tokenizer, draft=draft if speculative == "draft" else None)
    core = SchedulerCore(Capabilities(prefill_step_size=step_size, context_size=8192,
                                      max_batch_size=settings.max_batch_size, bucket_starts=executor.bucket_starts),
                         tokenizer=loaded.tokenizer, eos_token_ids=frozenset(loaded.eos_token_ids))
    clients = _Clients()
    for index, prompt in enumerate(prompts):
        core.add(NewRequest(request_id=f"r{index}", prompt_tokens=prompt, max_tokens=reply_tokens,
                            sampling=SamplingParams(temperature=0.0), cache_context=None), clients)
    decode_seconds = full_seconds = 0.0
    decode_tokens = full_tokens = steps = 0
    while core.has_work():
        assert core.next_lookup(0.0) is None
        plan = core.schedule()
        started = time.perf_counter()
        result = executor.run_step(plan)
        elapsed = time.perf_counter() - started
        core.update(plan, result, clients, 0.0)
        if result.prefill_tokens == 0 and not plan.starts and result.sampled:
            decode_seconds += elapsed
            decode_tokens += len(result.sampled)
            steps += 1
            if len({token.sequence_id for token in result.sampled}) == len(prompts):
                full_seconds += elapsed  # every stream still decoding: the batch not yet draining
                full_tokens += len(result.sampled)
    stats = executor.speculation_stats
    return {
        "speculative": speculative, "decode_tokens": decode_tokens, "decode_steps": steps,
        "decode_seconds": round(decode_seconds, 3),
        "tokens_per_second": round(decode_tokens / decode_seconds, 2) if decode_seconds else None,
        # Steps in which every stream emitted: rows that speculation moved ahead finish first, and the batch's
        # last steps run few rows (a closed batch's drain, which arrivals would fill in a server).
        "full_batch_tokens_per_second": round(full_tokens / full_seconds, 2) if full_seconds else None,
        "full_batch_share_of_tokens": round(full_tokens / decode_tokens, 3) if decode_tokens else None,
        "verify_steps": stats.verify_steps, "proposed_tokens": stats.proposed_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "acceptance_rate": round(stats.accepted_tokens / stats.proposed_tokens, 3) if stats.proposed_tokens else None,
        # A draft model's prefill of each row's context, inside the decode steps above; without it:
        "draft_prefill_seconds": round(stats.draft_prefill_seconds, 3),
        "tokens_per_second_past_draft_prefill": (
            round(decode_tokens / (decode_seconds - stats.draft_prefill_seconds), 2)
            if decode_seconds > stats.draft_prefill_seconds else None),
        "reply_tokens": [len(clients.tokens.get(f"r{i}", [])) for i in range(len(prompts))],
        "_replies": [clients.tokens.get(f"r{i}", []) for i in range(len(prompts))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", type=Path, required=True)
    parser.add_argument("--workloads", default="edit,copy,repeat,fresh")
    parser.add_argument("--streams", default="1,8")
    parser.add_argument("--reply-tokens", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=4, help="--speculative-tokens")
    parser.add_argument("--prefill-step-size", type=int, default=512)
    parser.add_argument("--file-lines", type=int, default=330, help="the edit workload's file (330: ~2.8k tokens)")
    parser.add_argument("--modes", default="ngram",
                        help="speculative modes run against off: ngram, draft, and either with -open (the gate held "
                             "open: every step with proposals verifies, as before the gate)")
    parser.add_argument("--draft-model", type=Path, help="--speculative draft's model (same tokenizer)")
    parser.add_argument("--warmup-tokens", type=int, default=0,
                        help="before each workload's timed runs, run every mode once with this many reply tokens, "
                             "untimed (on CUDA: kernel compiles and GEMM plans are built once per process)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    modes = args.modes.split(",")
    if any(mode.startswith("draft") for mode in modes) and args.draft_model is None:
        parser.error("--modes draft needs --draft-model")

    from mlxcel.blas import load_optimized_blas_in_process

    load_optimized_blas_in_process()
    import mlx.core as mx

    from mlxcel.model.loader import load_model

    loaded = load_model(args.model_path)
    draft = None
    if any(mode.startswith("draft") for mode in modes):
        from mlxcel.model.draft import load_draft

        draft = load_draft(args.draft_model, loaded.tokenizer, prefill_step_size=args.prefill_step_size)
    rows = []
    for workload in args.workloads.split(","):
        for streams in (int(text) for text in args.streams.split(",")):
            prompts = workload_prompts(workload, loaded.tokenizer, streams, args.file_lines)
            runs = {}
            for mode in ("off", *modes) if args.warmup_tokens else ():
                run(loaded, args.model_path, prompts, speculative=mode, tokens=args.tokens,
                    reply_tokens=args.warmup_tokens, step_size=args.prefill_step_size, draft=draft)
            for mode in ("off", *modes):
                runs[mode] = run(loaded, args.model_path, prompts, speculative=mode, tokens=args.tokens,
                                 reply_tokens=args.reply_tokens, step_size=args.prefill_step_size, draft=draft)
            off = runs["off"]
            replies = {mode: result.pop("_replies") for mode, result in runs.items()}
            row: dict[str, Any] = {"workload": workload, "streams": streams,
                                   "prompt_tokens": sum(len(p) for p in prompts) // len(prompts), "off": off}
            line = (f"{workload:7s} streams={streams:2d} prompt~{row['prompt_tokens']:5d}  "
                    f"off {off['tokens_per_second']} tok/s")
            for mode in modes:
                on = runs[mode]
                identical = replies[mode] == replies["off"]
                ratio = (on["tokens_per_second"] / off["tokens_per_second"]
                         if on["tokens_per_second"] and off["tokens_per_second"] else None)
                row[mode] = {**on, "speedup": round(ratio, 3) if ratio else None, "identical": identical}
                line += (f" | {mode} {on['tokens_per_second']} tok/s x{row[mode]['speedup']} accepted "
                         f"{on['accepted_tokens']}/{on['proposed_tokens']} ({on['acceptance_rate']}) in "
                         f"{on['verify_steps']} verify steps identical={identical}")
                if streams > 1 and on["full_batch_tokens_per_second"] and off["full_batch_tokens_per_second"]:
                    full = on["full_batch_tokens_per_second"] / off["full_batch_tokens_per_second"]
                    row[mode]["full_batch_speedup"] = round(full, 3)
                    line += (f" [all {streams} decoding: x{round(full, 3)} over "
                             f"{round(100 * on['full_batch_share_of_tokens'])}% of its tokens]")
                if on["draft_prefill_seconds"]:
                    past = on["tokens_per_second_past_draft_prefill"]
                    line += (f" (draft prefill {on['draft_prefill_seconds']} s; without it {past} tok/s "
                             f"x{round(past / off['tokens_per_second'], 3) if past else None})")
            rows.append(row)
            print(line, flush=True)
    device = str(mx.default_device())
    if args.out:
        args.out.write_text(json.dumps({"device": device, "model": str(args.model_path), "tokens": args.tokens,
                                        "reply_tokens": args.reply_tokens, "modes": modes,
                                        "draft_model": str(args.draft_model) if args.draft_model else None,
                                        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
