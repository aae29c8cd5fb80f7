// c_reward: a numeric-answer reward written in C, built with clang for wasm32-wasi
// (wasi-libc) and made a component with the WASI preview-1 adapter (`build.sh`).
//
// Components:
// - `format`: 1 when the completion gives its answer as `<answer>NUMBER</answer>` (the last
//   such tag; the tag name is configurable), else 0;
// - `correct`: 1 when that number is close to the sample's `answer`, as Python's
//   `math.isclose` decides: |x - y| <= max(rel_tol * max(|x|, |y|), abs_tol), else 0.
//
// Config (JSON, all optional): {"rel_tol": 1e-6, "abs_tol": 0, "tag": "answer"}.
// The sample's metadata must hold `answer` as a JSON number or a numeric string.
//
// The bindings in `bindings/` are generated from wit/ by rlhost (`rlhost plugin new` writes
// the same files for a new C plugin); a host test checks that they are current.

#include "bindings/reward_plugin.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct exports_rlhost_plugin_reward_scorer_t {
    double rel_tol;
    double abs_tol;
    char open_tag[80];
    char close_tag[80];
};

// ---------------------------------------------------------------- a small JSON reader
//
// Enough JSON to read a flat object of numbers and strings: values are located by key at
// the top level of an object; anything else is skipped, but the whole text must be valid.

typedef struct {
    const char *at;
    const char *end;
} cursor;

static void skip_space(cursor *c) {
    while (c->at < c->end && (*c->at == ' ' || *c->at == '\t' || *c->at == '\n' || *c->at == '\r')) {
        c->at++;
    }
}

static bool skip_value(cursor *c, int depth);

// Reads a JSON string at the cursor into `out` (UTF-8, at most `cap - 1` bytes), unescaping
// it. `out` may be NULL to skip the string.
static bool read_string(cursor *c, char *out, size_t cap) {
    size_t n = 0;
    if (c->at >= c->end || *c->at != '"') {
        return false;
    }
    c->at++;
    while (c->at < c->end && *c->at != '"') {
        unsigned char ch = (unsigned char)*c->at++;
        if (ch < 0x20) {
            return false;
        }
        if (ch == '\\') {
            if (c->at >= c->end) {
                return false;
            }
            char e = *c->at++;
            switch (e) {
            case '"': case '\\': case '/': ch = (unsigned char)e; break;
            case 'b': ch = '\b'; break;
            case 'f': ch = '\f'; break;
            case 'n': ch = '\n'; break;
            case 'r': ch = '\r'; break;
            case 't': ch = '\t'; break;
            case 'u':
                // Kept as '?': none of this plugin's keys or tags need escapes beyond ASCII.
                for (int i = 0; i < 4; i++) {
                    if (c->at >= c->end || !isxdigit((unsigned char)*c->at)) {
                        return false;
                    }
                    c->at++;
                }
                ch = '?';
                break;
            default: return false;
            }
        }
        if (out != NULL) {
            if (n + 1 >= cap) {
                return false;
            }
            out[n++] = (char)ch;
        }
    }
    if (c->at >= c->end) {
        return false;
    }
    c->at++;
    if (out != NULL) {
        out[n] = '\0';
    }
    return true;
}

static bool read_number(cursor *c, double *out) {
    // JSON's grammar: -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
    const char *p = c->at;
    if (p < c->end && *p == '-') p++;
    if (p >= c->end || !isdigit((unsigned char)*p)) return false;
    if (*p == '0') p++;
    else while (p < c->end && isdigit((unsigned char)*p)) p++;
    if (p < c->end && *p == '.') {
        p++;
        if (p >= c->end || !isdigit((unsigned char)*p)) return false;
        while (p < c->end && isdigit((unsigned char)*p)) p++;
    }
    if (p < c->end && (*p == 'e' || *p == 'E')) {
        p++;
        if (p < c->end && (*p == '+' || *p == '-')) p++;
        if (p >= c->end || !isdigit((unsigned char)*p)) return false;
        while (p < c->end && isdigit((unsigned char)*p)) p++;
    }
    char buf[64];
    size_t len = (size_t)(p - c->at);
    if (len >= sizeof buf) return false;
    memcpy(buf, c->at, len);
    buf[len] = '\0';
    if (out != NULL) *out = strtod(buf, NULL);
    c->at = p;
    return true;
}

static bool skip_literal(cursor *c, const char *word) {
    size_t len = strlen(word);
    if ((size_t)(c->end - c->at) < len || memcmp(c->at, word, len) != 0) return false;
    c->at += len;
    return true;
}

static bool skip_value(cursor *c, int depth) {
    if (depth > 64) return false;
    skip_space(c);
    if (c->at >= c->end) return false;
    switch (*c->at) {
    case '"': return read_string(c, NULL, 0);
    case 't': return skip_literal(c, "true");
    case 'f': return skip_literal(c, "false");
    case 'n': return skip_literal(c, "null");
    case '[':
    case '{': {
        char close = *c->at == '[' ? ']' : '}';
        bool object = close == '}';
        c->at++;
        skip_space(c);
        if (c->at < c->end && *c->at == close) {
            c->at++;
            return true;
        }
        for (;;) {
            if (object) {
                skip_space(c);
                if (!read_string(c, NULL, 0)) return false;
                skip_space(c);
                if (c->at >= c->end || *c->at != ':') return false;
                c->at++;
            }
            if (!skip_value(c, depth + 1)) return false;
            skip_space(c);
            if (c->at < c->end && *c->at == ',') {
                c->at++;
                continue;
            }
            if (c->at < c->end && *c->at == close) {
                c->at++;
                return true;
            }
            return false;
        }
    }
    default: return read_number(c, NULL);
    }
}

// Calls `field(key, value cursor, user)` for each member of the JSON object in `text`;
// `field` must consume the value. Returns an error message or NULL.
typedef const char *(*field_fn)(const char *key, cursor *value, void *user);

static const char *each_field(const char *text, size_t len, field_fn field, void *user) {
    cursor all = {text, text + len};
    if (!skip_value(&all, 0)) return "is not valid JSON";
    skip_space(&all);
    if (all.at != all.end) return "is not valid JSON (text after the value)";
    cursor c = {text, text + len};
    skip_space(&c);
    if (*c.at != '{') return "must be a JSON object";
    c.at++;
    skip_space(&c);
    if (*c.at == '}') return NULL;
    for (;;) {
        char key[64];
        skip_space(&c);
        if (!read_string(&c, key, sizeof key)) return "has a key longer than 63 bytes";
        skip_space(&c);
        c.at++; // ':' (checked by skip_value above)
        skip_space(&c);
        const char *err = field(key, &c, user);
        if (err != NULL) return err;
        skip_space(&c);
        if (*c.at == ',') {
            c.at++;
            continue;
        }
        return NULL; // '}'
    }
}

// ---------------------------------------------------------------- config and metadata

static char message[256];

static const char *config_field(const char *key, cursor *value, void *user) {
    exports_rlhost_plugin_reward_scorer_t *s = user;
    if (strcmp(key, "rel_tol") == 0 || strcmp(key, "abs_tol") == 0) {
        double v;
        if (!read_number(value, &v) || !(v >= 0) || !isfinite(v)) {
            snprintf(message, sizeof message, "`%s` must be a number >= 0", key);
            return message;
        }
        if (key[0] == 'r') s->rel_tol = v;
        else s->abs_tol = v;
        return NULL;
    }
    if (strcmp(key, "tag") == 0) {
        char tag[64];
        if (!read_string(value, tag, sizeof tag) || tag[0] == '\0' || strpbrk(tag, "<>/ ") != NULL) {
            return "`tag` must be a tag name of 1 to 63 bytes without `<`, `>`, `/` or spaces";
        }
        snprintf(s->open_tag, sizeof s->open_tag, "<%s>", tag);
        snprintf(s->close_tag, sizeof s->close_tag, "</%s>", tag);
        return NULL;
    }
    snprintf(message, sizeof message, "unknown field `%s`, expected one of rel_tol, abs_tol, tag", key);
    return message;
}

typedef struct {
    bool found;
    double answer;
} metadata;

// Parses a whole string as a number: optional spaces around, nothing else.
static bool parse_number(const char *s, size_t len, double *out) {
    char buf[128];
    while (len > 0 && isspace((unsigned char)*s)) { s++; len--; }
    while (len > 0 && isspace((unsigned char)s[len - 1])) len--;
    if (len == 0 || len >= sizeof buf) return false;
    memcpy(buf, s, len);
    buf[len] = '\0';
    char *end;
    errno = 0;
    double v = strtod(buf, &end);
    if (*end != '\0' || errno == ERANGE || !isfinite(v)) return false;
    *out = v;
    return true;
}

static const char *metadata_field(const char *key, cursor *value, void *user) {
    metadata *m = user;
    if (strcmp(key, "answer") != 0) {
        return skip_value(value, 0) ? NULL : "is not valid JSON";
    }
    if (*value->at == '"') {
        char text[128];
        if (!read_string(value, text, sizeof text) || !parse_number(text, strlen(text), &m->answer)) {
            return "`answer` is a string that is not a number";
        }
    } else if (!read_number(value, &m->answer)) {
        return "`answer` must be a number or a numeric string";
    }
    m->found = true;
    return NULL;
}

// ---------------------------------------------------------------- the exports

static void set_error(reward_plugin_string_t *err, const char *prefix, const char *what) {
    char text[400];
    snprintf(text, sizeof text, "%s %s", prefix, what);
    reward_plugin_string_dup(err, text);
}

void exports_rlhost_plugin_about_info(exports_rlhost_plugin_about_plugin_info_t *ret) {
    reward_plugin_string_dup(&ret->name, "c_reward");
    reward_plugin_string_dup(&ret->version, "0.1.0");
    reward_plugin_string_dup(&ret->description,
                             "Numeric answer within a tolerance, and its format (written in C)");
}

bool exports_rlhost_plugin_reward_static_scorer_open(reward_plugin_string_t *config,
                                                     exports_rlhost_plugin_reward_own_scorer_t *ret,
                                                     reward_plugin_string_t *err) {
    exports_rlhost_plugin_reward_scorer_t *s = malloc(sizeof *s);
    if (s == NULL) {
        reward_plugin_string_free(config);
        reward_plugin_string_dup(err, "c_reward: out of memory");
        return false;
    }
    s->rel_tol = 1e-6;
    s->abs_tol = 0;
    strcpy(s->open_tag, "<answer>");
    strcpy(s->close_tag, "</answer>");
    const char *problem = config->len == 0
        ? NULL
        : each_field((const char *)config->ptr, config->len, config_field, s);
    reward_plugin_string_free(config);
    if (problem != NULL) {
        free(s);
        set_error(err, "c_reward config:", problem);
        return false;
    }
    *ret = exports_rlhost_plugin_reward_scorer_new(s);
    return true;
}

// The last `<tag>…</tag>` of `text` as a number.
static bool tagged_number(const exports_rlhost_plugin_reward_scorer_t *s, const char *text, size_t len,
                          double *out) {
    size_t open_len = strlen(s->open_tag), close_len = strlen(s->close_tag);
    // Search backwards for the last closing tag, then its opening tag before it.
    for (size_t end = len >= close_len ? len - close_len + 1 : 0; end-- > 0;) {
        if (memcmp(text + end, s->close_tag, close_len) != 0) continue;
        for (size_t start = end >= open_len ? end - open_len + 1 : 0; start-- > 0;) {
            if (memcmp(text + start, s->open_tag, open_len) != 0) continue;
            const char *body = text + start + open_len;
            return parse_number(body, (size_t)(text + end - body), out);
        }
        return false;
    }
    return false;
}

bool exports_rlhost_plugin_reward_method_scorer_score(exports_rlhost_plugin_reward_borrow_scorer_t self,
                                                      exports_rlhost_plugin_reward_trajectory_t *trajectory,
                                                      exports_rlhost_plugin_reward_list_component_t *ret,
                                                      reward_plugin_string_t *err) {
    metadata meta = {false, 0};
    const char *problem = each_field((const char *)trajectory->metadata.ptr, trajectory->metadata.len,
                                     metadata_field, &meta);
    if (problem == NULL && !meta.found) {
        problem = "has no `answer`";
    }
    if (problem != NULL) {
        exports_rlhost_plugin_reward_trajectory_free(trajectory);
        set_error(err, "c_reward: the sample's metadata", problem);
        return false;
    }
    double given;
    bool formatted = tagged_number(self, (const char *)trajectory->completion.ptr,
                                   trajectory->completion.len, &given);
    exports_rlhost_plugin_reward_trajectory_free(trajectory);
    double scale = fmax(fabs(given), fabs(meta.answer));
    bool close = formatted && fabs(given - meta.answer) <= fmax(self->rel_tol * scale, self->abs_tol);

    ret->len = 2;
    ret->ptr = malloc(2 * sizeof *ret->ptr);
    if (ret->ptr == NULL) {
        ret->len = 0;
        reward_plugin_string_dup(err, "c_reward: out of memory");
        return false;
    }
    reward_plugin_string_dup(&ret->ptr[0].name, "format");
    ret->ptr[0].value = formatted ? 1.0 : 0.0;
    reward_plugin_string_dup(&ret->ptr[1].name, "correct");
    ret->ptr[1].value = close ? 1.0 : 0.0;
    return true;
}

void exports_rlhost_plugin_reward_scorer_destructor(exports_rlhost_plugin_reward_scorer_t *rep) {
    free(rep);
}
