"""Does building step N+1 before step N is done copy the whole KV cache (slice update not done in place)?"""
import sys, time
from mlxcel.blas import load_optimized_blas_in_process; load_optimized_blas_in_process()
import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
path, batch, prompt_len, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
model, _ = load(path)
def fresh():
    cache = make_prompt_cache(model)
    first = mx.argmax(model(mx.array([[10 + i % 1000 for i in range(prompt_len)]] * batch), cache=cache)[:, -1], axis=-1)
    mx.eval(first)
    return cache, first
def step(tokens, cache):
    return mx.argmax(model(tokens[:, None], cache=cache)[:, -1, :], axis=-1)
for order in ("queued before the wait (mlx_lm.generate)", "queued after the wait", "serial"):
    cache, current = fresh()
    following = step(current, cache); mx.async_eval(following)
    for timed in (False, True):
        started = time.perf_counter()
        for _ in range(steps if timed else 4):
            if order.startswith("serial"):
                mx.eval(following); current, following = following, step(following, cache)
            elif order == "queued after the wait":
                nxt = step(following, cache); mx.eval(following); mx.async_eval(nxt); current, following = following, nxt
            else:
                current, following = following, step(following, cache); mx.async_eval(following); mx.eval(current)
            current.tolist()
    print(f"{order}: {1000 * (time.perf_counter() - started) / steps:.2f} ms a step", flush=True)
