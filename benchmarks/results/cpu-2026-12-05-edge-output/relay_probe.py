# The engine side of one streamed token: RequestOutput.add and the link sink, against TokenRelay.count and the sink
# (docs/benchmarks.md, "Issue 28, fifteenth pass"). Run from the repository: PYTHONPATH=. .venv/bin/python THIS_FILE.
import time
from mlxcel import blas; blas.load_optimized_blas_in_process()
from mlx_lm.tokenizer_utils import load as load_tok
from mlxcel.core.output import RequestOutput, TokenRelay
from mlxcel.core.plan import SampledToken
from mlxcel.http.engine_link import LinkSink, Outbox
from mlxcel.types import SamplingParams
import pathlib
from mlxcel.fixtures import fixture_path
tok = load_tok(pathlib.Path(fixture_path("llama")))
ids = tok.encode(open(pathlib.Path(__file__).resolve().parents[3] / "docs" / "architecture.md").read()[:30000])[:5000]
tokens = [SampledToken(sequence_id=0, token=i, logprob=-0.5) for i in ids]
def engine_side(relay):
    outbox = Outbox(); sinks = {}
    sink = sinks["r"] = LinkSink(outbox, "r", sinks)
    if relay:
        out = TokenRelay(eos_token_ids=frozenset([0]), prompt_tokens=10, submitted_at=0.0)
    else:
        out = RequestOutput(tokenizer=tok, sampling=SamplingParams(), eos_token_ids=frozenset([0]), prompt_tokens=10, submitted_at=0.0)
    t = time.perf_counter()
    for i, token in enumerate(tokens):
        if relay:
            out.count(token.token, None, 1.0); sink.send_nowait(token)
        else:
            o = out.add(token.token, token.logprob, (), None, 1.0)
            if o.delta is not None: sink.send_nowait(o.delta)
        if i % 64 == 63: outbox._messages.clear()
    return (time.perf_counter() - t) / len(tokens) * 1e6
for relay in (False, True, False, True):
    print("relay" if relay else "engine output", [round(engine_side(relay), 2) for _ in range(3)])
