"""TF Serving's REST API in Python, for the tests: a JSON predict request to input arrays, outputs to the JSON
answer, by the rules of tensorflow_serving/util/json_tensor.cc (TF Serving's "RESTful API" guide).

Requests:
- "signature_name" (default "serving_default"), and exactly one of "instances" (row format) or "inputs"
  (columnar format).
- Row format: a non-empty list. Its elements are objects naming every input of the signature, exactly; or,
  when the signature has one input, the values themselves. Each input's values stack into a batch.
- Columnar format: an object naming every input, or, for one input, its value.
- A value is a number, a string, a list (nested as deep as the tensor's rank, each level of one length), or
  {"b64": ...} (base64, the object's only key), which only a string input takes.

Answers: row format, {"predictions": [...]}: one object of every output per instance, or the values alone
when there is one output; a string output whose name ends in "_bytes" as {"b64": ...}, other strings as text.
"""

import base64
import json

import numpy as np


class RequestError(ValueError):
    """What TF Serving answers with HTTP 400."""


def _is_b64(value):
    return isinstance(value, dict) and len(value) == 1 and isinstance(value.get("b64"), str)


def _is_named(value):
    return isinstance(value, dict) and not _is_b64(value)


def _leaf(value, dtype):
    if _is_b64(value):
        if dtype != np.object_:
            raise RequestError(f"JSON Value: {value} not formatted correctly for base64 data")
        return base64.b64decode(value["b64"], validate=True)
    if isinstance(value, dict):
        raise RequestError(f"JSON Value: {value} not of the expected type")
    if dtype == np.object_:
        if not isinstance(value, str):
            raise RequestError(f"JSON Value: {value!r} is not a string")
        return value.encode("utf-8")
    if isinstance(value, (str, bool)) and dtype != np.bool_:
        raise RequestError(f"JSON Value: {value!r} is not a number")
    return value


def _tensor(value, dtype):
    """A JSON value as an array of `dtype` (np.object_ for strings), lists checked to be rectangular."""

    def convert(item):
        if isinstance(item, list):
            return [convert(element) for element in item]
        return _leaf(item, dtype)

    converted = convert(value)
    array = np.empty((), dtype=object) if dtype == np.object_ and not isinstance(converted, list) else None
    if array is not None:
        array[()] = converted
        return array
    try:
        return np.array(converted, dtype=dtype)
    except ValueError as error:
        raise RequestError(f"Encountered list at unexpected size: {error}") from error


def decode_request(body, signatures):
    """(signature name, {input: array}) of a JSON predict request `body`; `signatures` maps each signature name
    to {input name: NumPy dtype} (np.object_ for strings)."""
    request = json.loads(body)
    if not isinstance(request, dict):
        raise RequestError("Is not object")
    name = request.get("signature_name", "serving_default")
    if name not in signatures:
        raise RequestError(f'Serving signature name: "{name}" not found in signature def')
    inputs = signatures[name]
    if ("instances" in request) == ("inputs" in request):
        raise RequestError("Missing 'inputs' or 'instances' key, or both given")
    if "instances" in request:
        rows = request["instances"]
        if not isinstance(rows, list) or not rows:
            raise RequestError("Expecting 'instances' to be a non-empty list")
        if _is_named(rows[0]):
            for index, row in enumerate(rows):
                if not _is_named(row) or set(row) != set(inputs):
                    raise RequestError(
                        f"Failed to process element: {index} of 'instances' list. keys must be equal to: "
                        f"{','.join(sorted(inputs))}"
                    )
            columns = {alias: [row[alias] for row in rows] for alias in inputs}
        else:
            if len(inputs) > 1:
                raise RequestError(
                    "instances is a plain list, but expecting list of objects as multiple input tensors required"
                )
            columns = {next(iter(inputs)): rows}
        arrays = {alias: _tensor(values, inputs[alias]) for alias, values in columns.items()}
        for alias, array in arrays.items():
            if array.ndim == 0 or array.shape[0] != len(rows):
                raise RequestError(f"Input {alias}: the instances do not stack into one batch")
        return name, arrays
    columns = request["inputs"]
    if _is_named(columns):
        missing = set(inputs) - set(columns)
        if missing:
            raise RequestError(f"Missing named input: {sorted(missing)[0]} in 'inputs' object.")
        return name, {alias: _tensor(columns[alias], inputs[alias]) for alias in inputs}
    if len(inputs) > 1:
        raise RequestError("inputs is a plain value/list, but expecting an object as multiple input tensors required")
    alias = next(iter(inputs))
    return name, {alias: _tensor(columns, inputs[alias])}


def _json_value(name, value):
    if isinstance(value, np.ndarray):
        return [_json_value(name, item) for item in value]
    if isinstance(value, bytes):
        if name.endswith("_bytes"):
            return {"b64": base64.b64encode(value).decode("ascii")}
        return value.decode("utf-8")
    return value.item() if isinstance(value, np.generic) else value


def encode_response(outputs):
    """The row-format JSON answer for `outputs` ({output name: array with the batch first})."""
    sizes = {name: len(array) for name, array in outputs.items()}
    if len(set(sizes.values())) != 1:
        raise RequestError(f"Tensors have inconsistent batch sizes: {sizes}")
    batch = next(iter(sizes.values()))
    if len(outputs) == 1:
        ((name, array),) = outputs.items()
        predictions = [_json_value(name, array[index]) for index in range(batch)]
    else:
        predictions = [
            {name: _json_value(name, array[index]) for name, array in outputs.items()} for index in range(batch)
        ]
    return json.dumps({"predictions": predictions})
