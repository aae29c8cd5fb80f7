// {{name}}: an environment (it answers each assistant turn), in C built with clang for
// wasm32-wasi and made a component with the WASI preview-1 adapter. This one keeps the
// model talking for three turns and rewards a last turn that says `done`. Replace the game
// with yours.
//
// Config: none ({}). The bindings in bindings/ are generated from wit/ by rlhost.

#include "bindings/environment_plugin.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TURNS 3

// One trajectory's episode.
struct exports_rlhost_plugin_environment_episode_t {
    int turn;
};

static bool no_config(environment_plugin_string_t *config, environment_plugin_string_t *err);

bool exports_rlhost_plugin_environment_static_episode_open(environment_plugin_string_t *config,
                                                           exports_rlhost_plugin_environment_sample_t *sample,
                                                           exports_rlhost_plugin_environment_own_episode_t *ret,
                                                           environment_plugin_string_t *err) {
    exports_rlhost_plugin_environment_sample_free(sample);
    if (!no_config(config, err)) {
        return false;
    }
    exports_rlhost_plugin_environment_episode_t *episode = calloc(1, sizeof *episode);
    if (episode == NULL) {
        environment_plugin_string_dup(err, "{{name}}: out of memory");
        return false;
    }
    *ret = exports_rlhost_plugin_environment_episode_new(episode);
    return true;
}

// Whether `s` (n bytes) holds "done" in any case.
static bool says_done(const char *s, size_t n) {
    for (size_t i = 0; i + 4 <= n; i++) {
        if (tolower((unsigned char)s[i]) == 'd' && tolower((unsigned char)s[i + 1]) == 'o' &&
            tolower((unsigned char)s[i + 2]) == 'n' && tolower((unsigned char)s[i + 3]) == 'e') {
            return true;
        }
    }
    return false;
}

bool exports_rlhost_plugin_environment_method_episode_step(exports_rlhost_plugin_environment_borrow_episode_t self,
                                                           environment_plugin_string_t *assistant,
                                                           exports_rlhost_plugin_environment_step_result_t *ret,
                                                           environment_plugin_string_t *err) {
    (void)err;
    self->turn++;
    memset(ret, 0, sizeof *ret);
    if (self->turn >= TURNS) {
        ret->done = true;
        ret->reward.is_some = true;
        ret->reward.val = says_done((const char *)assistant->ptr, assistant->len) ? 1.0 : 0.0;
    } else {
        char content[160];
        snprintf(content, sizeof content, "You wrote %zu bytes. %d turns to go; say done in the last.",
                 assistant->len, TURNS - self->turn);
        ret->messages.len = 1;
        // calloc: the fields not set here (the message's tool calls) are empty.
        ret->messages.ptr = calloc(1, sizeof *ret->messages.ptr);
        environment_plugin_string_dup(&ret->messages.ptr[0].role, "user");
        environment_plugin_string_dup(&ret->messages.ptr[0].content, content);
    }
    environment_plugin_string_free(assistant);
    return true;
}

void exports_rlhost_plugin_environment_episode_destructor(exports_rlhost_plugin_environment_episode_t *rep) {
    free(rep);
}
