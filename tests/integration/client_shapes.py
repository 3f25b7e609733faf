"""Requests as agent CLIs send them, built field by field from the clients' own code.

Codex (openai/codex, Rust): the body is `ResponsesApiRequest` in
codex-rs/codex-api/src/common.rs (model, instructions, input, tools,
tool_choice "auto", parallel_tool_calls, reasoning {effort, summary}, store
false, stream true, include, prompt_cache_key, text, client_metadata); the tools are
`ToolSpec` in codex-rs/core/src/client_common.rs, serialized with
`#[serde(tag = "type")]`: `function` tools, `{"type": "web_search"}`, and the
freeform `apply_patch` (`{"type": "custom", "name", "description", "format":
{"type": "grammar", "syntax": "lark", "definition"}}`), whose grammar is
codex-rs/core/src/tools/handlers/tool_apply_patch.lark and whose description
is that of codex-rs/core/src/tools/handlers/apply_patch_spec.rs; the shell
tool is `create_shell_command_tool` in codex-rs/core/src/tools/spec.rs.

Claude Code (closed source: the shapes its requests are seen to have, and the
`anthropic` SDK's types it is built on, `OutputConfigParam` and
`ThinkingConfig*Param` in anthropic/types): a billing-header line and cached
system blocks, tools with draft-07 input schemas, `metadata.user_id`,
adaptive thinking, `output_config.effort`, `context_management`, a
cache_control breakpoint on the last user block, streamed.
"""

from __future__ import annotations

from typing import Any

APPLY_PATCH_LARK = """start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?

hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?

filename: /(.+)/
add_line: "+" /(.*)/ LF -> line

change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF

%import common.LF
"""

APPLY_PATCH_TOOL = {
    "type": "custom", "name": "apply_patch",
    "description": "Use the `apply_patch` tool to edit files. This is a FREEFORM tool, so do not wrap the patch in JSON.",
    "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH_LARK},
}
SHELL_COMMAND_TOOL = {
    "type": "function", "name": "shell_command",
    "description": "Runs a shell command and returns its output.", "strict": False,
    "parameters": {"type": "object", "properties": {
        "command": {"type": "string", "description": "The shell script to execute in the user's default shell"},
        "workdir": {"type": "string", "description": "The working directory to execute the command in"},
        "timeout_ms": {"type": "number", "description": "The timeout for the command in milliseconds"},
    }, "required": ["command"], "additionalProperties": False},
}
UPDATE_PLAN_TOOL = {
    "type": "function", "name": "update_plan", "description": "Updates the task plan.", "strict": False,
    "parameters": {"type": "object", "properties": {
        "explanation": {"type": "string"},
        "plan": {"type": "array", "items": {"type": "object", "properties": {
            "step": {"type": "string"}, "status": {"type": "string"}}, "required": ["step", "status"],
            "additionalProperties": False}},
    }, "required": ["plan"], "additionalProperties": False},
}
CODEX_INSTRUCTIONS = "You are Codex, a coding agent. Keep going until the task is done. Use apply_patch to edit files."


def codex_request(model: str, *, prompt: str = "Add a README saying hello.", history: list[Any] | None = None,
                  stream: bool = True) -> dict[str, Any]:
    """One turn of Codex's Responses request (its field order, its defaults for a non-OpenAI provider)."""
    return {
        "model": model,
        "instructions": CODEX_INSTRUCTIONS,
        "input": [
            {"type": "message", "role": "developer", "content": [
                {"type": "input_text", "text": "<permissions instructions>Sandbox: workspace-write.</permissions instructions>"}]},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "<environment_context>\n  <cwd>/repo</cwd>\n  <shell>bash</shell>\n"
                                                "</environment_context>"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": prompt}]},
            *(history or []),
        ],
        "tools": [SHELL_COMMAND_TOOL, UPDATE_PLAN_TOOL, APPLY_PATCH_TOOL, {"type": "web_search"}],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": stream,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b",
        # `response_create_client_metadata` (codex-api/src/common.rs): the W3C trace context, when there is one.
        "client_metadata": {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
    }


def sdk_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """A wire body as `openai` SDK keyword arguments: what the SDK has no parameter for goes in extra_body."""
    kwargs = dict(body)
    extra = {key: kwargs.pop(key) for key in ("client_metadata",) if key in kwargs}
    return {**kwargs, "extra_body": extra} if extra else kwargs


BILLING_LINE = "x-anthropic-billing-header: cc_version=2.1.37.abc; cc_entrypoint=cli; cch=5d3e1;"
CLAUDE_CODE_SYSTEM = "You are Claude Code, Anthropic's official CLI for Claude."
BASH_TOOL = {
    "name": "Bash", "description": "Executes a given bash command and returns its output.",
    "input_schema": {"type": "object", "properties": {
        "command": {"type": "string", "description": "The command to execute"},
        "timeout": {"type": "number", "description": "Optional timeout in milliseconds (max 600000)"},
        "description": {"type": "string", "description": "Clear, concise description of what this command does"},
    }, "required": ["command"], "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"},
}
READ_TOOL = {
    "name": "Read", "description": "Reads a file from the local filesystem.",
    "input_schema": {"type": "object", "properties": {
        "file_path": {"type": "string", "description": "The absolute path to the file to read"},
        "offset": {"type": "number"}, "limit": {"type": "number"},
    }, "required": ["file_path"], "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"},
}


def claude_code_request(model: str, *, prompt: str = "What is the capital of France?", stream: bool = True,
                        max_tokens: int = 32000) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>\nAs you answer the user's questions, you can use the "
                                     "following context: the project is a small library.\n</system-reminder>"},
            {"type": "text", "text": prompt, "cache_control": {"type": "ephemeral"}},
        ]}],
        "system": [
            {"type": "text", "text": BILLING_LINE},
            {"type": "text", "text": CLAUDE_CODE_SYSTEM, "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "You are an interactive CLI tool that helps users with software engineering "
                                     "tasks. Be concise.", "cache_control": {"type": "ephemeral"}},
        ],
        "tools": [BASH_TOOL, READ_TOOL],
        "metadata": {"user_id": "user_4f2a_account__session_7c1e9b20-5d3a-4e8f-9a1b-2c3d4e5f6a7b"},
        "max_tokens": max_tokens,
        "thinking": {"type": "adaptive"},
        "output_config": {"effort": "medium"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "stream": stream,
    }
