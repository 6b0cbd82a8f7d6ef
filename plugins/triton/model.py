"""The Triton Python backend model that mqa-triton writes into its model repository (as
<model>/1/model.py). It runs inside Triton's Python backend stub, one process per model instance, with
.venv-triton's packages (numpy, Triton's triton_python_backend_utils): it imports nothing of ours, and
only carries each request to the one engine process over its Unix socket (plugins/triton/bridge.py)
and the engine's answers back as Triton responses.

The model is decoupled: `execute` returns at once and each request is answered from this stub's
event loop, as many responses as the engine sends (one when `stream` is false: Triton's /generate
takes exactly one), the last with the final flag. Every instance shares the engine, so requests of
all instances batch together.
"""

import asyncio
import json
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

LINE_LIMIT = 64 << 20
CANCEL_POLL_S = 0.5   # how often a request waiting for its next tokens checks whether Triton cancelled it
METRICS_S = 1.0       # how often the engine's metrics are copied into Triton's /metrics
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _error(message: str, code: str = "INTERNAL"):
    codes = pb_utils.TritonError
    return pb_utils.TritonError(message, getattr(codes, code, codes.INTERNAL))


def _values(tensor) -> list:
    """A tensor's elements as JSON values; bytes as text (invalid UTF-8 kept as surrogates, which the
    engine refuses by name)."""
    array = tensor.as_numpy().reshape(-1)
    if array.dtype == np.object_ or array.dtype.kind == "S":
        return [v.decode("utf-8", "surrogateescape") if isinstance(v, bytes) else str(v) for v in array]
    return array.tolist()


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.socket = config["parameters"]["engine_socket"]["string_value"]
        self.inputs = [i["name"] for i in config["input"]]
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="mqa-engine-client", daemon=True)
        self.thread.start()
        self.metrics = asyncio.run_coroutine_threadsafe(self._mirror_metrics(), self.loop)

    def execute(self, requests):
        for request in requests:
            asyncio.run_coroutine_threadsafe(self._serve(request), self.loop)
        return None

    def finalize(self):
        async def shutdown():  # Triton drained its requests first; whatever is left ends with an error
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    async def _serve(self, request):
        sender = request.get_response_sender()
        writer = None
        try:
            body = {"inputs": {}, "parameters": json.loads(request.parameters() or "{}")}
            for name in self.inputs:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    body["inputs"][name] = _values(tensor)
            reader, writer = await asyncio.open_unix_connection(self.socket, limit=LINE_LIMIT)
            writer.write(json.dumps(body).encode() + b"\n")
            await writer.drain()
            while True:
                try:
                    line = await asyncio.wait_for(reader.readline(), CANCEL_POLL_S)
                except asyncio.TimeoutError:
                    line = None
                if request.is_cancelled():  # the client left: closing our end frees its slot
                    sender.send(pb_utils.InferenceResponse(error=_error("request cancelled", "CANCELLED")),
                                flags=FINAL)
                    return
                if line is None:
                    continue
                if not line:
                    raise ConnectionError("the engine closed the request (is it stopping?)")
                msg = json.loads(line)
                if "error" in msg:
                    sender.send(pb_utils.InferenceResponse(error=_error(msg["error"], msg.get("code"))), flags=FINAL)
                    return
                last = "finish" in msg
                sender.send(self._response(msg), flags=FINAL if last else 0)
                if last:
                    return
        except asyncio.CancelledError:  # finalize: the model is unloading
            sender.send(pb_utils.InferenceResponse(error=_error("the server is stopping", "UNAVAILABLE")), flags=FINAL)
        except Exception as e:  # noqa: BLE001 - whatever failed, the request gets its one final answer
            sender.send(pb_utils.InferenceResponse(error=_error(f"{type(e).__name__}: {e}"[:300], "UNAVAILABLE")),
                        flags=FINAL)
        finally:
            if writer is not None:
                writer.close()

    @staticmethod
    def _response(msg: dict):
        tensors = [pb_utils.Tensor("text_output", np.array([msg["text"].encode()], dtype=np.object_))]
        if "finish_reason" in msg:
            tensors.append(pb_utils.Tensor("finish_reason", np.array([msg["finish_reason"].encode()],
                                                                     dtype=np.object_)))
        for name in ("num_input_tokens", "num_output_tokens"):
            if name in msg:
                tensors.append(pb_utils.Tensor(name, np.array([msg[name]], dtype=np.uint32)))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    async def _mirror_metrics(self):
        """Copy the engine's Prometheus samples into Triton's /metrics, from one instance only (the
        engine says which): mqa_* gauges as gauges, counters (histograms' _bucket, _sum and _count
        included) as counters."""
        reader, writer = await asyncio.open_unix_connection(self.socket, limit=LINE_LIMIT)
        try:
            writer.write(b'{"op": "metrics"}\n')
            await writer.drain()
            if not json.loads(await reader.readline()).get("owner"):
                return
            families, metrics, seen = {}, {}, {}
            while True:
                writer.write(b"metrics\n")
                await writer.drain()
                for name, kind, doc, labels, value in json.loads(await reader.readline())["samples"]:
                    if name not in families:
                        families[name] = pb_utils.MetricFamily(
                            name=name, description=doc,
                            kind=pb_utils.MetricFamily.GAUGE if kind == "gauge" else pb_utils.MetricFamily.COUNTER)
                    key = (name, tuple(sorted(labels.items())))
                    if key not in metrics:
                        metrics[key] = families[name].Metric(labels=labels)
                    if kind == "gauge":
                        metrics[key].set(value)
                    elif value > seen.get(key, 0.0):
                        metrics[key].increment(value - seen.get(key, 0.0))
                        seen[key] = value
                await asyncio.sleep(METRICS_S)
        finally:
            writer.close()
