/*
 * spark.h — the C ABI of a spark backend plugin, version 1.
 *
 * A backend library (libspark_backend_<name>.so) exports one entry symbol,
 * spark_backend_v1_<name> or (the cpu backend, and third-party plugins) spark_backend_v1, which
 * returns a table of functions that run the Spark-X2.5 model step by step: a batch of
 * (sequence id, tokens, start position) in, logits out. These declarations match the Rust
 * #[repr(C)] types of spark-core/src/plugin/abi.rs field for field (a test checks every size
 * and offset).
 *
 * Rules:
 *  - Read `abi_version` first (it is the first field of every version's table) and refuse any
 *    value other than SPARK_ABI_VERSION before calling anything.
 *  - Functions returning int32_t return SPARK_OK (0) or a SPARK_ERR_* code; on error,
 *    last_error() returns the message (never NULL), valid until the next call into the library
 *    from the same thread.
 *  - No panic or C++ exception crosses the boundary: a crash inside the backend is returned as
 *    SPARK_ERR_PANIC, after which the handle refuses every call except close.
 *  - One spark_executor must not be used by two threads at once; different handles may be.
 *  - Strings are NUL-terminated UTF-8. The library must stay loaded while any handle is open.
 */
#ifndef SPARK_H
#define SPARK_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SPARK_ABI_VERSION 1u
#define SPARK_ENTRY_SYMBOL "spark_backend_v1"

/* Status codes. */
#define SPARK_OK 0
#define SPARK_ERR_INVALID_INPUT 1 /* an argument, token id, position or buffer length */
#define SPARK_ERR_BAD_MODEL 2     /* a model file is missing, truncated or malformed */
#define SPARK_ERR_OUT_OF_MEMORY 3
#define SPARK_ERR_UNSUPPORTED 4
#define SPARK_ERR_IO 5
#define SPARK_ERR_BACKEND 6       /* a device failure */
#define SPARK_ERR_INTERNAL 7      /* a bug */
#define SPARK_ERR_PANIC 8         /* the backend crashed; close the handle */

/* spark_open_options.dtype and spark_exec_info.dtype. */
#define SPARK_DTYPE_DEFAULT 0u /* the checkpoint's stored type (options only) */
#define SPARK_DTYPE_F32 1u
#define SPARK_DTYPE_BF16 2u
#define SPARK_DTYPE_F16 3u

/* spark_seq_step.logits. */
#define SPARK_LOGITS_NONE 0u
#define SPARK_LOGITS_LAST 1u /* the row of the last token */
#define SPARK_LOGITS_ALL 2u  /* one row per token */

#define SPARK_DEVICE_NAME_LEN 128
#define SPARK_DEVICE_CAPS_LEN 128
#define SPARK_DEVICE_NOTE_LEN 256

/* One device a backend can run on. */
typedef struct spark_device_info {
    uint32_t index;        /* pass as spark_open_options.device */
    uint32_t usable;       /* 1: can run now; 0: cannot (note says why) */
    int32_t score;         /* preference for automatic choice, higher is better: CPU 10..50, accelerators 100+ */
    uint32_t reserved;     /* 0 */
    uint64_t memory_total; /* bytes, 0 = unknown */
    uint64_t memory_free;  /* bytes, 0 = unknown */
    char name[SPARK_DEVICE_NAME_LEN];
    char capabilities[SPARK_DEVICE_CAPS_LEN]; /* e.g. "avx2+fma" */
    char note[SPARK_DEVICE_NOTE_LEN];
} spark_device_info;

/* How to open a model; all zeros (or a NULL pointer) means defaults. */
typedef struct spark_open_options {
    uint32_t threads;  /* 0: backend default (one per core) */
    uint32_t ctx_size; /* 0: min(max_position_embeddings, 4096) */
    uint32_t dtype;    /* SPARK_DTYPE_* */
    uint32_t device;   /* index from probe */
} spark_open_options;

/* Facts about an open executor. */
typedef struct spark_exec_info {
    uint64_t vocab; /* width of a logits row */
    uint64_t ctx;   /* largest position + 1 that can be served */
    uint32_t dtype; /* SPARK_DTYPE_F32, _BF16 or _F16 */
    uint32_t reserved;
} spark_exec_info;

/* One sequence's part of a forward call. */
typedef struct spark_seq_step {
    uint64_t seq_id;
    const uint32_t *tokens;
    size_t n_tokens;    /* at least 1 */
    uint32_t start_pos; /* the sequence's cached length (or less, to rewind) */
    uint32_t logits;    /* SPARK_LOGITS_* */
} spark_seq_step;

/* An open model on a backend: opaque, owned by the library until close. */
typedef struct spark_executor spark_executor;

typedef struct spark_backend_v1 {
    uint32_t abi_version; /* SPARK_ABI_VERSION of the spark the plugin was built with */
    uint32_t table_size;  /* sizeof(spark_backend_v1) as the plugin sees it */
    const char *name;     /* "cpu", "cuda", ...: static */

    /* Write up to `capacity` records to `devices` (NULL if capacity is 0) and the number of
     * devices to *count. */
    int32_t (*probe)(spark_device_info *devices, uint32_t capacity, uint32_t *count);
    /* Load the checkpoint directory `model_path` (config.json + *.safetensors); options may be
     * NULL. On success *out is a new handle; on failure it is NULL. */
    int32_t (*open)(const char *model_path, const spark_open_options *options, spark_executor **out);
    int32_t (*info)(spark_executor *handle, spark_exec_info *out);
    /* Run one step over `n_steps` sequences (each at most once per call). Writes the requested
     * logits rows, in step order, each `vocab` floats wide, to `logits`; `logits_len` (in
     * floats) must equal the number of rows asked for times vocab. A sequence seen for the
     * first time starts at position 0. A step refused by its argument checks changes nothing; one that
     * fails while running releases its sequences (their caches would be inconsistent). */
    int32_t (*forward)(spark_executor *handle, const spark_seq_step *steps, size_t n_steps, float *logits,
                       size_t logits_len);
    /* Drop a sequence's KV cache (no-op if unknown). */
    int32_t (*release)(spark_executor *handle, uint64_t seq_id);
    /* Copy src's KV cache to dst (replacing dst). */
    int32_t (*fork)(spark_executor *handle, uint64_t src, uint64_t dst);
    /* Cached length of a sequence, -1 if unknown. */
    int32_t (*seq_len)(spark_executor *handle, uint64_t seq_id, int64_t *out);
    /* KV-cache bytes in use over all sequences. */
    int32_t (*kv_bytes)(spark_executor *handle, uint64_t *out);
    /* Free the executor (NULL: no-op). */
    void (*close)(spark_executor *handle);
    /* The calling thread's last error message in this library; never NULL. */
    const char *(*last_error)(void);
} spark_backend_v1;

/* The type of the exported symbol SPARK_ENTRY_SYMBOL. */
typedef const spark_backend_v1 *(*spark_backend_entry_fn)(void);

#ifdef __cplusplus
}
#endif

#endif /* SPARK_H */
