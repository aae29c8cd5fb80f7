// {{name}}: a dataset (a source of task samples), in C built with clang for wasm32-wasi and
// made a component with the WASI preview-1 adapter. This one makes 1000 addition problems
// whose answer is in the sample's metadata. Replace the problems with yours; keep each
// sample a function of the seed and the index alone, so that runs repeat and resume
// exactly.
//
// Config: none ({}). The bindings in bindings/ are generated from wit/ by rlhost.

#include "bindings/dataset_plugin.h"

#include <ctype.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#define SIZE 1000

struct exports_rlhost_plugin_dataset_source_t {
    uint64_t seed;
};

static bool no_config(dataset_plugin_string_t *config, dataset_plugin_string_t *err);

// SplitMix64: a small, seedable generator.
static uint64_t mix(uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

bool exports_rlhost_plugin_dataset_static_source_open(dataset_plugin_string_t *config, uint64_t seed,
                                                      exports_rlhost_plugin_dataset_own_source_t *ret,
                                                      dataset_plugin_string_t *err) {
    if (!no_config(config, err)) {
        return false;
    }
    exports_rlhost_plugin_dataset_source_t *source = calloc(1, sizeof *source);
    if (source == NULL) {
        dataset_plugin_string_dup(err, "{{name}}: out of memory");
        return false;
    }
    source->seed = seed;
    *ret = exports_rlhost_plugin_dataset_source_new(source);
    return true;
}

uint64_t exports_rlhost_plugin_dataset_method_source_len(exports_rlhost_plugin_dataset_borrow_source_t self) {
    (void)self;
    return SIZE;
}

bool exports_rlhost_plugin_dataset_method_source_get(exports_rlhost_plugin_dataset_borrow_source_t self,
                                                     uint64_t index, exports_rlhost_plugin_dataset_sample_t *ret,
                                                     dataset_plugin_string_t *err) {
    if (index >= SIZE) {
        char text[80];
        snprintf(text, sizeof text, "index %" PRIu64 " is past the %d samples", index, SIZE);
        dataset_plugin_string_dup(err, text);
        return false;
    }
    uint64_t r = mix(self->seed ^ mix(index));
    unsigned a = (unsigned)(r % 1000), b = (unsigned)((r >> 32) % 1000);
    char prompt[96], metadata[48];
    snprintf(prompt, sizeof prompt, "What is %u + %u? Answer as <answer>N</answer>.", a, b);
    snprintf(metadata, sizeof metadata, "{\"answer\": %u}", a + b);
    ret->messages.len = 1;
    // calloc: the fields not set here (the message's tool calls) are empty.
    ret->messages.ptr = calloc(1, sizeof *ret->messages.ptr);
    dataset_plugin_string_dup(&ret->messages.ptr[0].role, "user");
    dataset_plugin_string_dup(&ret->messages.ptr[0].content, prompt);
    dataset_plugin_string_dup(&ret->metadata, metadata);
    return true;
}

void exports_rlhost_plugin_dataset_source_destructor(exports_rlhost_plugin_dataset_source_t *rep) {
    free(rep);
}
