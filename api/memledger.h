/* memledger's C ABI: predict a training run's memory from a JSON request.
 *
 * One call takes a JSON object with the command line's fields and returns the JSON that
 * `predict` prints (the same schema), or an error code with a one-line message. No C++
 * type crosses the boundary; strings the library returns are freed with memledger_free.
 * The library needs no LibTorch. Thread-safe: calls may run concurrently.
 *
 * Request keys (all optional; the CLI's defaults): "model" (a built-in name such as
 * "llama-3-8b", a config.json path, or a config.json's object itself), "layers", "width", "heads", "kv_heads",
 * "head_dim", "intermediate", "vocab", "batch", "seq", "every", "tp", "dp", "pp",
 * "virtual_stages", "micro_batches", "zero", "ep" (integers), "variants", "policy",
 * "attention", "dtype", "amp", "optimizer", "optimizer_impl", "checkpoint_impl", "freeze",
 * "lora_targets", "lora_rank" (integer), "lora_alpha", "lora_dropout" (numbers),
 * "schedule", "experts_impl", "routing", "device", "sdpa_backend",
 * "cublas_workspace_config", "mp_param_dtype", "mp_reduce_dtype", "offload",
 * "offload_activations" (strings),
 * "momentum", "cuda_context_mib", "ddp_bucket_mb" (numbers), "master_weights", "use_dora", "sp",
 * "gradient_as_bucket_view", "fsdp", "expandable_segments", "explain" (booleans),
 * "reshard_after_forward" (a boolean, or an integer: fully_shard's), "format" ("json",
 * the default; "table": the CLI's table text; predict's "svg": its --timeline_svg chart, with
 * "dp" or "pp" the most loaded rank's step),
 * and predict's own: "cpu_threads" (an integer), "sweep" (predict's --sweep grid, a
 * string; then "format" is "csv", the default, or "jsonl", the response is the rows, and
 * "budget_gib", a number, adds each row's fit). An unknown key is an error. With "dp" or
 * "pp" above 1 the response is predict's per-rank JSON: the most loaded rank's buckets,
 * "parallel" and "ranks" (each with its whole-step "peak_bytes" where simulated, which
 * replays the rank's layers: milliseconds for a large model, not microseconds).
 *
 * memledger_plan takes the same keys (but "explain"; "dp" and "pp" only as 1) plus
 * "budget_gib" (a number,
 * required), "frontier_points" (an integer, default 9), "cpu_threads" and
 * "flops_per_second" (a number: with it, the plan's step time), and returns
 * the checkpoint planner's JSON (`//planner --format=json`: plan, peak_bytes, overhead,
 * variants, frontier); "format" may also be "table", "svg" (the plan's step, its
 * --timeline_svg chart) or "frontier_svg" (its --frontier_svg chart).
 *
 * memledger_search takes the run's keys (but "micro_batches" and "schedule", which
 * follow from the layout; "tp", "sp", "pp", "dp", "zero", "virtual_stages" and "batch",
 * the micro-batch size, fix that part of the layout) plus "gpus" and "global_batch"
 * (integers, required), "gpus_per_node", "max_virtual_stages", "threads",
 * "planned_layouts", "checked_layouts", "top", "longest_seq" (integers: instead of
 * "seq", the longest sequence up to it that a layout fits), "gpu_memory_gib", "mfu"
 * (numbers) and "gpu" (a string), and returns the layout search's JSON
 * (`//planner:search --format=json`: every layout that fits, fastest first, with the
 * flags that reproduce it); "format" may also be "table" or "svg" (its --chart_svg
 * chart).
 *
 * Example:
 *   char* response = NULL;
 *   char* error = NULL;
 *   int rc = memledger_predict("{\"model\": \"llama-3-8b\", \"batch\": 1, \"seq\": 8192}",
 *                              &response, &error);
 *   if (rc == MEMLEDGER_OK) puts(response); else fprintf(stderr, "%s\n", error);
 *   memledger_free(response);
 *   memledger_free(error);
 */
#ifndef API_MEMLEDGER_H_
#define API_MEMLEDGER_H_

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* MEMLEDGER_ABI_VERSION changes when a function's signature or meaning changes. */
#define MEMLEDGER_ABI_VERSION 1

/* Return codes of memledger_predict, as the CLI's exit statuses. */
#define MEMLEDGER_OK 0
#define MEMLEDGER_INTERNAL 1
#define MEMLEDGER_INVALID_ARGUMENT 2
/* memledger_plan: no plan fits the budget; memledger_search: no layout fits the GPUs'
 * memory. The message names the smallest that would. */
#define MEMLEDGER_NO_PLAN 3
#define MEMLEDGER_NO_LAYOUT 3

/* memledger_version: "memledger <ABI version> (torch <release>, transformers <release>)",
 * static storage. */
const char* memledger_version(void);

/* memledger_abi_version: MEMLEDGER_ABI_VERSION of the library actually loaded. */
int memledger_abi_version(void);

/* memledger_predict parses `request_json` and predicts. On MEMLEDGER_OK *response_json
 * holds the prediction's JSON and *error_message is NULL; otherwise *response_json is
 * NULL and *error_message holds one line naming the bad key or value. Either pointer
 * out-argument may be NULL to discard that string. REQUIRES: request_json is a
 * NUL-terminated string (NULL is reported as an invalid argument). */
int memledger_predict(const char* request_json, char** response_json, char** error_message);

/* memledger_plan parses `request_json` and plans checkpointing under its "budget_gib":
 * MEMLEDGER_OK with the planner's JSON, MEMLEDGER_INVALID_ARGUMENT for bad input,
 * MEMLEDGER_NO_PLAN when no plan fits; out-arguments as memledger_predict's. */
int memledger_plan(const char* request_json, char** response_json, char** error_message);

/* memledger_search searches the parallel layouts of the request's model over its "gpus":
 * MEMLEDGER_OK with the search's JSON (or table or chart), MEMLEDGER_INVALID_ARGUMENT
 * for bad input, MEMLEDGER_NO_LAYOUT when no layout fits; out-arguments as
 * memledger_predict's. */
int memledger_search(const char* request_json, char** response_json, char** error_message);

/* memledger_predict_many predicts a JSON array of requests (each predict's keys but
 * "explain", "dp" and "pp") in one call, on `threads` threads (0: the machine's cores),
 * with each variant's step peak when `peak` is nonzero. On MEMLEDGER_OK *response_json
 * is a JSON array, in the requests' order, of compact results: {"n_params",
 * "param_bytes", "grad_bytes", "optimizer_state_bytes", "saved_bytes": {variant: bytes},
 * "peak_bytes": {variant: bytes or null}} (peak_bytes only with `peak`). The first bad
 * request fails the call: MEMLEDGER_INVALID_ARGUMENT, "requests[i]: <message>". */
int memledger_predict_many(const char* requests_json, int peak, int threads,
                           char** response_json, char** error_message);

/* memledger_snapshot parses `request_json` (predict's keys but "explain", "dp" and "pp";
 * "variants" naming one variant) and returns that variant's predicted step as a PyTorch
 * memory snapshot: the pickle torch.cuda.memory._snapshot() writes (see predict
 * --snapshot_out), *snapshot_size bytes at *snapshot (binary: it holds NULs).
 * MEMLEDGER_INVALID_ARGUMENT with one line for bad input; out-arguments as
 * memledger_predict's (the size 0 on error). */
int memledger_snapshot(const char* request_json, char** snapshot, size_t* snapshot_size,
                       char** error_message);

/* memledger_free releases a string memledger_predict, memledger_plan, memledger_search,
 * memledger_predict_many or memledger_snapshot returned; NULL is fine. */
void memledger_free(char* string);

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif  /* API_MEMLEDGER_H_ */
