//! A test plugin that claims a WIT version the host does not support, so that the
//! host's "built for another version" error can be tested. Not a real plugin.

mod bindings {
    wit_bindgen::generate!({
        inline: "
            package rlhost:plugin@9.0.0;

            interface about {
                info: func() -> string;
            }

            interface trigger {
                fire: func(text: string) -> string;
            }

            world later {
                export about;
                export trigger;
            }
        ",
    });
}

struct Future;

impl bindings::exports::rlhost::plugin::about::Guest for Future {
    fn info() -> String {
        "future_version".into()
    }
}

impl bindings::exports::rlhost::plugin::trigger::Guest for Future {
    fn fire(text: String) -> String {
        text
    }
}

bindings::export!(Future with_types_in bindings);
