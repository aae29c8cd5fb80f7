// {{name}}: a trigger (a tool the model calls in the middle of generation), in C built with
// clang for wasm32-wasi and made a component with the WASI preview-1 adapter. This one
// upper-cases what the model writes between <shout> and </shout> and returns it as
// <result>…</result>. Replace the tool with yours.
//
// Config: none ({}). The bindings in bindings/ are generated from wit/ by rlhost.

#include "bindings/trigger_plugin.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>

#define OPEN "<shout>"
#define CLOSE "</shout>"

// One trajectory's session: it may keep state between the calls of that trajectory.
struct exports_rlhost_plugin_trigger_session_t {
    int calls;
};

static bool no_config(trigger_plugin_string_t *config, trigger_plugin_string_t *err);

bool exports_rlhost_plugin_trigger_static_session_open(trigger_plugin_string_t *config,
                                                       exports_rlhost_plugin_trigger_sample_t *sample,
                                                       exports_rlhost_plugin_trigger_own_session_t *ret,
                                                       trigger_plugin_string_t *err) {
    exports_rlhost_plugin_trigger_sample_free(sample);
    if (!no_config(config, err)) {
        return false;
    }
    exports_rlhost_plugin_trigger_session_t *session = calloc(1, sizeof *session);
    if (session == NULL) {
        trigger_plugin_string_dup(err, "{{name}}: out of memory");
        return false;
    }
    *ret = exports_rlhost_plugin_trigger_session_new(session);
    return true;
}

void exports_rlhost_plugin_trigger_method_session_stop_patterns(exports_rlhost_plugin_trigger_borrow_session_t self,
                                                                trigger_plugin_list_string_t *ret) {
    (void)self;
    ret->len = 1;
    ret->ptr = malloc(sizeof *ret->ptr);
    trigger_plugin_string_dup(&ret->ptr[0], CLOSE);
}

bool exports_rlhost_plugin_trigger_method_session_fire(exports_rlhost_plugin_trigger_borrow_session_t self,
                                                       trigger_plugin_string_t *text,
                                                       trigger_plugin_option_string_t *ret,
                                                       trigger_plugin_string_t *err) {
    const char *s = (const char *)text->ptr;
    size_t n = text->len, close = strlen(CLOSE), open = strlen(OPEN);
    ret->is_some = false;
    // The host fires when the text ends with a stop pattern; check anyway.
    if (n >= close && memcmp(s + n - close, CLOSE, close) == 0) {
        size_t end = n - close;
        for (size_t start = end >= open ? end - open + 1 : 0; start-- > 0;) {
            if (memcmp(s + start, OPEN, open) != 0) continue;
            size_t from = start + open, len = end - from;
            char *out = malloc(len + sizeof "<result></result>");
            if (out == NULL) {
                trigger_plugin_string_free(text);
                trigger_plugin_string_dup(err, "{{name}}: out of memory");
                return false;
            }
            memcpy(out, "<result>", 8);
            for (size_t i = 0; i < len; i++) out[8 + i] = (char)toupper((unsigned char)s[from + i]);
            memcpy(out + 8 + len, "</result>", 9);
            ret->is_some = true;
            trigger_plugin_string_dup_n(&ret->val, out, len + 17);
            free(out);
            self->calls++;
            break;
        }
    }
    trigger_plugin_string_free(text);
    return true;
}

void exports_rlhost_plugin_trigger_session_destructor(exports_rlhost_plugin_trigger_session_t *rep) {
    free(rep);
}
