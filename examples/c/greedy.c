/*
 * greedy.c — embed spark from C: load a backend plugin with dlopen, check its ABI version, open a
 * checkpoint, and decode greedily from a prompt given as token ids.
 *
 *   cc -std=c11 -Wall -Wextra -I include examples/c/greedy.c -o greedy -ldl
 *   ./greedy target/release/libspark_backend_cpu.so testdata/golden/m8/ckpt_f32 0,337,411,410,55 24
 *
 * Prints the generated ids, comma separated, on one line. Errors go to stderr with the backend's
 * message and a non-zero exit status.
 */
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "spark.h"

/* Parse "0,337,411" into a new array; returns the count, or 0 on a malformed list. */
static size_t parse_ids(const char *s, uint32_t **out) {
    size_t cap = 16, n = 0;
    uint32_t *ids = malloc(cap * sizeof *ids);
    if (!ids) return 0;
    while (*s) {
        char *end;
        errno = 0;
        unsigned long v = strtoul(s, &end, 10);
        if (end == s || errno || v > UINT32_MAX || (*end && *end != ',')) {
            free(ids);
            return 0;
        }
        if (n == cap) {
            uint32_t *more = realloc(ids, (cap *= 2) * sizeof *ids);
            if (!more) {
                free(ids);
                return 0;
            }
            ids = more;
        }
        ids[n++] = (uint32_t)v;
        s = *end ? end + 1 : end;
    }
    *out = ids;
    return n;
}

/* Index of the largest value (the first one on ties). */
static uint32_t argmax(const float *v, size_t n) {
    size_t best = 0;
    for (size_t i = 1; i < n; i++)
        if (v[i] > v[best]) best = i;
    return (uint32_t)best;
}

static int fail(const spark_backend_v1 *b, const char *what, int32_t code) {
    fprintf(stderr, "greedy: %s failed (status %d): %s\n", what, (int)code, b->last_error());
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 4 || argc > 5) {
        fprintf(stderr, "usage: %s LIBSPARK_BACKEND.so MODEL_DIR IDS [N_NEW=24]\n", argv[0]);
        return 2;
    }
    const char *lib_path = argv[1], *model = argv[2];
    long n_new = 24;
    if (argc == 5) {
        char *end;
        n_new = strtol(argv[4], &end, 10);
        if (*end || n_new < 0) {
            fprintf(stderr, "greedy: N_NEW '%s' is not a non-negative number\n", argv[4]);
            return 2;
        }
    }
    uint32_t *prompt = NULL;
    size_t n_prompt = parse_ids(argv[3], &prompt);
    if (n_prompt == 0) {
        fprintf(stderr, "greedy: IDS '%s' is not a comma-separated list of token ids\n", argv[3]);
        return 2;
    }

    void *lib = dlopen(lib_path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "greedy: cannot load %s: %s\n", lib_path, dlerror());
        return 1;
    }
    spark_backend_entry_fn entry;
    /* POSIX: dlsym's object pointer converts to a function pointer this way. */
    *(void **)(&entry) = dlsym(lib, SPARK_ENTRY_SYMBOL);
    if (!entry) {
        fprintf(stderr, "greedy: %s is not a spark backend: no symbol %s\n", lib_path, SPARK_ENTRY_SYMBOL);
        return 1;
    }
    const spark_backend_v1 *b = entry();
    /* The version first, before touching anything else in the table. */
    if (!b || b->abi_version != SPARK_ABI_VERSION) {
        fprintf(stderr, "greedy: %s speaks spark ABI version %u, this program speaks version %u\n", lib_path,
                b ? b->abi_version : 0u, SPARK_ABI_VERSION);
        return 1;
    }
    if (b->table_size < sizeof *b) {
        fprintf(stderr, "greedy: %s: function table too small (%u bytes)\n", lib_path, b->table_size);
        return 1;
    }

    spark_open_options opts = {0}; /* defaults: all cores, ctx min(max_positions, 4096), stored dtype */
    spark_executor *h = NULL;
    int32_t rc = b->open(model, &opts, &h);
    if (rc != SPARK_OK) return fail(b, "open", rc);
    spark_exec_info info;
    rc = b->info(h, &info);
    if (rc != SPARK_OK) return fail(b, "info", rc);
    float *logits = malloc(info.vocab * sizeof *logits);
    if (!logits) {
        fprintf(stderr, "greedy: out of memory\n");
        return 1;
    }

    /* Prefill the prompt, asking for the last row only; then feed back one token at a time. */
    uint32_t next = 0;
    spark_seq_step step = {.seq_id = 1, .tokens = prompt, .n_tokens = n_prompt, .start_pos = 0, .logits = SPARK_LOGITS_LAST};
    for (long i = 0; i < n_new; i++) {
        rc = b->forward(h, &step, 1, logits, (size_t)info.vocab);
        if (rc != SPARK_OK) return fail(b, "forward", rc);
        next = argmax(logits, (size_t)info.vocab);
        printf(i ? ",%u" : "%u", next);
        step.start_pos += (uint32_t)step.n_tokens;
        step.tokens = &next;
        step.n_tokens = 1;
    }
    printf("\n");

    b->close(h);
    free(logits);
    free(prompt);
    /* No dlclose: like spark itself, leave the backend loaded until exit (its worker threads may
     * still be winding down after close). */
    return 0;
}
