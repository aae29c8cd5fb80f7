// {{name}}: a reward (it scores finished trajectories into named components), in C built
// with clang for wasm32-wasi and made a component with the WASI preview-1 adapter. This one
// gives `format` (the completion answers in <answer>…</answer>) and `correct` (that answer
// is the sample's `answer` from its metadata, compared as text; 0 when the sample has
// none). Replace the scoring with yours; the run config weighs the components.
//
// Config: none ({}). The bindings in bindings/ are generated from wit/ by rlhost.

#include "bindings/reward_plugin.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>

struct exports_rlhost_plugin_reward_scorer_t {
    int unused;
};

static bool no_config(reward_plugin_string_t *config, reward_plugin_string_t *err);

bool exports_rlhost_plugin_reward_static_scorer_open(reward_plugin_string_t *config,
                                                     exports_rlhost_plugin_reward_own_scorer_t *ret,
                                                     reward_plugin_string_t *err) {
    if (!no_config(config, err)) {
        return false;
    }
    exports_rlhost_plugin_reward_scorer_t *scorer = calloc(1, sizeof *scorer);
    if (scorer == NULL) {
        reward_plugin_string_dup(err, "{{name}}: out of memory");
        return false;
    }
    *ret = exports_rlhost_plugin_reward_scorer_new(scorer);
    return true;
}

// The last occurrence of `needle` in s[0..n) that ends at or before `limit`, or -1.
static long last_of(const char *s, size_t limit, const char *needle) {
    size_t k = strlen(needle);
    for (size_t i = limit >= k ? limit - k + 1 : 0; i-- > 0;) {
        if (memcmp(s + i, needle, k) == 0) return (long)i;
    }
    return -1;
}

// Trims spaces from both ends of s[*from..*to).
static void trim(const char *s, size_t *from, size_t *to) {
    while (*from < *to && isspace((unsigned char)s[*from])) (*from)++;
    while (*to > *from && isspace((unsigned char)s[*to - 1])) (*to)--;
}

// The text of the metadata's "answer" value (a number, or a string without escapes), or
// false. A small reader for this template: use a JSON library for richer metadata.
static bool answer_of(const char *s, size_t n, size_t *from, size_t *to) {
    long key = last_of(s, n, "\"answer\"");
    if (key < 0) return false;
    size_t i = (size_t)key + 8;
    while (i < n && isspace((unsigned char)s[i])) i++;
    if (i >= n || s[i] != ':') return false;
    i++;
    while (i < n && isspace((unsigned char)s[i])) i++;
    if (i < n && s[i] == '"') {
        size_t end = ++i;
        while (end < n && s[end] != '"' && s[end] != '\\') end++;
        if (end >= n || s[end] != '"') return false;
        *from = i;
        *to = end;
    } else {
        size_t end = i;
        while (end < n && (isdigit((unsigned char)s[end]) || strchr("+-.eE", s[end]) != NULL)) end++;
        if (end == i) return false;
        *from = i;
        *to = end;
    }
    trim(s, from, to);
    return true;
}

bool exports_rlhost_plugin_reward_method_scorer_score(exports_rlhost_plugin_reward_borrow_scorer_t self,
                                                      exports_rlhost_plugin_reward_trajectory_t *trajectory,
                                                      exports_rlhost_plugin_reward_list_component_t *ret,
                                                      reward_plugin_string_t *err) {
    (void)self;
    const char *text = (const char *)trajectory->completion.ptr;
    size_t n = trajectory->completion.len;
    bool formatted = false, correct = false;
    long end = last_of(text, n, "</answer>");
    long start = end < 0 ? -1 : last_of(text, (size_t)end, "<answer>");
    if (start >= 0) {
        formatted = true;
        size_t from = (size_t)start + 8, to = (size_t)end;
        trim(text, &from, &to);
        size_t a, b;
        const char *meta = (const char *)trajectory->metadata.ptr;
        if (answer_of(meta, trajectory->metadata.len, &a, &b)) {
            correct = b - a == to - from && memcmp(meta + a, text + from, to - from) == 0;
        }
    }
    exports_rlhost_plugin_reward_trajectory_free(trajectory);
    ret->len = 2;
    ret->ptr = malloc(2 * sizeof *ret->ptr);
    if (ret->ptr == NULL) {
        ret->len = 0;
        reward_plugin_string_dup(err, "{{name}}: out of memory");
        return false;
    }
    reward_plugin_string_dup(&ret->ptr[0].name, "format");
    ret->ptr[0].value = formatted ? 1.0 : 0.0;
    reward_plugin_string_dup(&ret->ptr[1].name, "correct");
    ret->ptr[1].value = correct ? 1.0 : 0.0;
    return true;
}

void exports_rlhost_plugin_reward_scorer_destructor(exports_rlhost_plugin_reward_scorer_t *rep) {
    free(rep);
}
