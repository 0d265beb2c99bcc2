"""When a request is done: stop tokens, EOS (after min_tokens), and length limits."""
from __future__ import annotations

from engine_core.request import Request, RequestStatus


def check_stop(request: Request, token_id: int, max_seq_len: int) -> bool:
    """Called after `token_id` was appended; sets the final status and returns True if the
    request is finished. Stop strings are the front-end's business (it detokenizes).

    `max_seq_len` is max_model_len, or less when even the whole KV cache cannot compute a
    longer sequence; reaching it, or `max_tokens`, ends the request with "length".
    """
    params = request.sampling_params
    num_outputs = len(request.output_token_ids)
    if num_outputs >= request.min_tokens:
        if token_id == request.eos_token_id and not params.ignore_eos:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if params.stop_token_ids and token_id in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token_id
            return True
    if len(request.all_token_ids) >= max_seq_len or num_outputs >= request.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


def append_tokens(request: Request, token_ids: list[int], max_seq_len: int) -> list[int]:
    """Append the tokens one step sampled for the request, up to and including the first that
    finishes it; they take the place of one placeholder, if it had any. Returns those
    appended."""
    if request.num_output_placeholders:
        request.num_output_placeholders -= 1
    for k, token_id in enumerate(token_ids):
        request.output_token_ids.append(token_id)
        request.all_token_ids.append(token_id)
        if check_stop(request, token_id, max_seq_len):
            return token_ids[:k + 1]
    return token_ids
