// {{name}}: tools (functions the model calls in its own tool-call format), in C built with
// clang for wasm32-wasi and made a component with the WASI preview-1 adapter. This one has
// two: `add`, the sum of two integers (stateless), and `tally`, which adds an amount to
// the trajectory's running total and returns the total (it keeps state). Replace them
// with yours.
//
// In a run the host checks each call against the function's JSON Schema before it gets
// here; the checks below still refuse what does not fit (`rlhost plugin test` sends such
// calls), and an error returned is the function's own refusal, which the model reads.
//
// Config: none ({}). The bindings in bindings/ are generated from wit/ by rlhost.

#include "bindings/tools_plugin.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// The largest magnitude of an argument and of the total.
#define LIMIT 1000000000LL
#define INTEGER "{\"type\": \"integer\", \"minimum\": -1000000000, \"maximum\": 1000000000}"

// One trajectory's session: its state lives as long as the trajectory.
struct exports_rlhost_plugin_tools_session_t {
    long long total;
};

static bool no_config(tools_plugin_string_t *config, tools_plugin_string_t *err);

bool exports_rlhost_plugin_tools_static_session_open(tools_plugin_string_t *config,
                                                     exports_rlhost_plugin_tools_sample_t *sample,
                                                     exports_rlhost_plugin_tools_own_session_t *ret,
                                                     tools_plugin_string_t *err) {
    exports_rlhost_plugin_tools_sample_free(sample);
    if (!no_config(config, err)) {
        return false;
    }
    exports_rlhost_plugin_tools_session_t *session = calloc(1, sizeof *session);
    if (session == NULL) {
        tools_plugin_string_dup(err, "{{name}}: out of memory");
        return false;
    }
    *ret = exports_rlhost_plugin_tools_session_new(session);
    return true;
}

static void spec(exports_rlhost_plugin_tools_function_spec_t *f, const char *name, const char *description,
                 const char *parameters, bool stateless) {
    tools_plugin_string_dup(&f->name, name);
    tools_plugin_string_dup(&f->description, description);
    tools_plugin_string_dup(&f->parameters, parameters);
    f->stateless = stateless;
}

void exports_rlhost_plugin_tools_method_session_functions(exports_rlhost_plugin_tools_borrow_session_t self,
                                                          exports_rlhost_plugin_tools_list_function_spec_t *ret) {
    (void)self;
    ret->len = 2;
    ret->ptr = calloc(2, sizeof *ret->ptr);
    // Reads no state: its calls may run at once, each in a fresh instance.
    spec(&ret->ptr[0], "add", "The sum of two integers.",
         "{\"type\": \"object\", \"properties\": {\"a\": " INTEGER ", \"b\": " INTEGER
         "}, \"required\": [\"a\", \"b\"], \"additionalProperties\": false}",
         true);
    spec(&ret->ptr[1], "tally", "Adds an amount to the running total and returns the total.",
         "{\"type\": \"object\", \"properties\": {\"amount\": " INTEGER
         "}, \"required\": [\"amount\"], \"additionalProperties\": false}",
         false);
}

static size_t skip_space(const char *s, size_t n, size_t i) {
    while (i < n && isspace((unsigned char)s[i])) i++;
    return i;
}

// Reads `s` (n bytes): a JSON object whose fields are exactly `names` (at most 4), each an
// integer from -LIMIT to LIMIT, into `out` in the order of `names`. On failure writes the
// refusal into `why` and returns false. A plugin with richer arguments would use a JSON
// library such as cJSON here.
static bool read_integers(const char *s, size_t n, const char *const *names, size_t count, long long *out,
                          char *why, size_t why_len) {
    bool seen[4] = {false};
    size_t i = skip_space(s, n, 0);
    if (i >= n || s[i] != '{') {
        snprintf(why, why_len, "bad arguments: expected a JSON object");
        return false;
    }
    i = skip_space(s, n, i + 1);
    bool empty = i < n && s[i] == '}';
    if (empty) i++;
    while (!empty) {
        if (i >= n || s[i] != '"') {
            snprintf(why, why_len, "bad arguments: expected a field name");
            return false;
        }
        size_t start = ++i;
        while (i < n && s[i] != '"' && s[i] != '\\') i++;
        size_t len = i - start, k = count;
        for (size_t j = 0; j < count; j++) {
            if (strlen(names[j]) == len && memcmp(names[j], s + start, len) == 0) k = j;
        }
        if (i >= n || s[i] != '"' || k == count) {
            snprintf(why, why_len, "bad arguments: unknown field `%.*s`", (int)(len < 40 ? len : 40), s + start);
            return false;
        }
        if (seen[k]) {
            snprintf(why, why_len, "bad arguments: field `%s` twice", names[k]);
            return false;
        }
        i = skip_space(s, n, i + 1);
        if (i >= n || s[i] != ':') {
            snprintf(why, why_len, "bad arguments: expected `:` after `%s`", names[k]);
            return false;
        }
        i = skip_space(s, n, i + 1);
        bool negative = i < n && s[i] == '-';
        if (negative) i++;
        size_t digits = 0;
        long long value = 0;
        // More digits than LIMIT has are out of range: stop counting before overflow.
        for (; i < n && isdigit((unsigned char)s[i]); i++, digits++) {
            if (digits < 12) value = value * 10 + (s[i] - '0');
        }
        bool number_ends = i >= n || !(s[i] == '.' || s[i] == 'e' || s[i] == 'E');
        if (digits == 0 || !number_ends || value > LIMIT) {
            snprintf(why, why_len, "`%s` must be an integer from -%lld to %lld", names[k], LIMIT, LIMIT);
            return false;
        }
        out[k] = negative ? -value : value;
        seen[k] = true;
        i = skip_space(s, n, i);
        if (i < n && s[i] == ',') {
            i = skip_space(s, n, i + 1);
        } else if (i < n && s[i] == '}') {
            i++;
            break;
        } else {
            snprintf(why, why_len, "bad arguments: expected `,` or `}` after `%s`", names[k]);
            return false;
        }
    }
    if (skip_space(s, n, i) != n) {
        snprintf(why, why_len, "bad arguments: text after the object");
        return false;
    }
    for (size_t j = 0; j < count; j++) {
        if (!seen[j]) {
            snprintf(why, why_len, "bad arguments: missing field `%s`", names[j]);
            return false;
        }
    }
    return true;
}

bool exports_rlhost_plugin_tools_method_session_call(exports_rlhost_plugin_tools_borrow_session_t self,
                                                     tools_plugin_string_t *name,
                                                     tools_plugin_string_t *arguments,
                                                     tools_plugin_string_t *ret, tools_plugin_string_t *err) {
    static const char *const add[] = {"a", "b"};
    static const char *const tally[] = {"amount"};
    const char *args = (const char *)arguments->ptr;
    size_t n = arguments->len;
    char text[160] = "";
    long long x[2];
    bool ok = false;
    if (name->len == 3 && memcmp(name->ptr, "add", 3) == 0) {
        ok = read_integers(args, n, add, 2, x, text, sizeof text);
        if (ok) snprintf(text, sizeof text, "%lld", x[0] + x[1]);
    } else if (name->len == 5 && memcmp(name->ptr, "tally", 5) == 0) {
        ok = read_integers(args, n, tally, 1, x, text, sizeof text);
        long long total = ok ? self->total + x[0] : 0;
        if (ok && (total > LIMIT || total < -LIMIT)) {
            ok = false;
            snprintf(text, sizeof text, "the total would leave -%lld..%lld; it stays %lld", LIMIT, LIMIT,
                     self->total);
        } else if (ok) {
            self->total = total;
            snprintf(text, sizeof text, "%lld", total);
        }
    } else {
        snprintf(text, sizeof text, "there is no function `%.*s`", (int)(name->len < 40 ? name->len : 40),
                 (const char *)name->ptr);
    }
    tools_plugin_string_free(name);
    tools_plugin_string_free(arguments);
    tools_plugin_string_dup(ok ? ret : err, text);
    return ok;
}

void exports_rlhost_plugin_tools_session_destructor(exports_rlhost_plugin_tools_session_t *rep) {
    free(rep);
}
