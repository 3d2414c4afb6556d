"""The gRPC Gateway service: Generate (server stream), sessions and the model list."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import AsyncIterator

import grpc

from gateway.core import GatewayCore
from gateway.validation import generate_request
from splitserve.request_rules import check_request_id
from splitserve.errors import InvalidArgument, NotFound, SplitserveError, abort
from splitserve.proto import gateway_pb2, gateway_pb2_grpc, types_pb2
from splitserve.telemetry import incoming_context, request_id_var
from splitserve.wire import token_logprobs_to_proto


def _authorization(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value if isinstance(value, str) else value.decode()
    return None


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Gateway RPCs over the shared GatewayCore."""

    def __init__(self, core: GatewayCore):
        self.core = core

    async def Generate(self, request: gateway_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        try:
            caller = await self.core.authorize(_authorization(context))
            check_request_id(request.request_id)
            request_id = request.request_id or uuid.uuid4().hex
            request_id_var.set(request_id)
            req = generate_request(request, self.core.tokenization, self.core.limits, request_id)
            remaining = context.time_remaining()
            # The caller's deadline, on the loop clock, bounds queueing and the coordinator call.
            deadline = asyncio.get_running_loop().time() + remaining if remaining is not None else None
            stream = self.core.generate(req, api="grpc", deadline=deadline,
                                        trace_parent=incoming_context(context.invocation_metadata()), caller=caller)
            async with contextlib.aclosing(stream):
                async for delta in stream:
                    response = gateway_pb2.GenerateResponse(request_id=request_id, text=delta.text,
                                                            finish_reason=delta.finish_reason)
                    if req.echo_token_ids or req.logprobs is not None:
                        response.token_ids.extend(delta.token_ids)
                    if req.logprobs is not None:
                        response.logprobs.extend(token_logprobs_to_proto(lp) for lp in delta.logprobs)
                    if delta.finish_reason:
                        response.usage.CopyFrom(types_pb2.Usage(
                            prompt_tokens=delta.prompt_tokens, completion_tokens=delta.completion_tokens,
                            total_tokens=delta.prompt_tokens + delta.completion_tokens))
                    yield response
                    if delta.finish_reason:
                        return
        except SplitserveError as err:
            await abort(context, err)

    async def OpenSession(self, request: gateway_pb2.OpenSessionRequest,
                          context: grpc.aio.ServicerContext) -> gateway_pb2.OpenSessionResponse:
        try:
            caller = await self.core.authorize(_authorization(context))
            self._check_model(request.model)
            session_id, ttl = await self.core.open_session(request.session_id, request.ttl_s, caller.owner)
            return gateway_pb2.OpenSessionResponse(session_id=session_id, ttl_s=max(1, round(ttl)))
        except SplitserveError as err:
            await abort(context, err)

    async def CloseSession(self, request: gateway_pb2.CloseSessionRequest,
                           context: grpc.aio.ServicerContext) -> gateway_pb2.CloseSessionResponse:
        try:
            caller = await self.core.authorize(_authorization(context))
            if not request.session_id:
                raise InvalidArgument("session_id is required", param="session_id")
            return gateway_pb2.CloseSessionResponse(closed=await self.core.close_session(request.session_id,
                                                                                        caller.owner))
        except SplitserveError as err:
            await abort(context, err)

    async def ListModels(self, request: gateway_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> gateway_pb2.ListModelsResponse:
        try:
            await self.core.authorize(_authorization(context))
        except SplitserveError as err:
            await abort(context, err)
        # num_workers stays 0 until the gateway reads the worker registry (Redis).
        model = gateway_pb2.ModelInfo(id=self.core.model_name, engine_kind=self.core.tokenization.model_type,
                                      max_model_len=self.core.limits.max_model_len)
        return gateway_pb2.ListModelsResponse(models=[model])

    def _check_model(self, model: str) -> None:
        if model and model != self.core.model_name:
            raise NotFound(f"model '{model}' does not exist; this server serves '{self.core.model_name}'",
                           param="model")
