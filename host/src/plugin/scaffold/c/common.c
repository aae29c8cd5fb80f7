
// ---------------------------------------------------------------- shared by every role

void exports_rlhost_plugin_about_info(exports_rlhost_plugin_about_plugin_info_t *ret) {
    {{world}}_string_dup(&ret->name, "{{name}}");
    {{world}}_string_dup(&ret->version, "0.1.0");
    {{world}}_string_dup(&ret->description, "{{description}}");
}

// Checks that the JSON config is an empty object (this plugin takes no settings): text
// that is not JSON, or names a field, is an error to report rather than to ignore. Frees
// `config`; on failure sets `err` and returns false. A plugin with settings would parse
// them here, with a JSON library such as cJSON or with its own small reader.
static bool no_config({{world}}_string_t *config, {{world}}_string_t *err) {
    size_t i = 0, n = config->len;
    const char *s = (const char *)config->ptr;
    while (i < n && isspace((unsigned char)s[i])) i++;
    bool open = i < n && s[i] == '{';
    if (open) i++;
    while (i < n && isspace((unsigned char)s[i])) i++;
    bool close = open && i < n && s[i] == '}';
    if (close) i++;
    while (i < n && isspace((unsigned char)s[i])) i++;
    bool ok = close && i == n;
    {{world}}_string_free(config);
    if (!ok) {
        {{world}}_string_dup(err, "{{name}} config: it takes no settings, pass {}");
    }
    return ok;
}
