//! One definition of "an enum stored and sent as lowercase text", shared by every state type,
//! so the names in PostgreSQL, on the wire and in logs cannot drift apart.

/// Declares an enum with `ALL`, `as_str`, `Display` and `FromStr` over the given text names.
macro_rules! text_enum {
    (
        $(#[$doc:meta])*
        $vis:vis enum $name:ident ($what:literal) {
            $( $(#[$vdoc:meta])* $variant:ident = $text:literal ),+ $(,)?
        }
    ) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
        #[serde(rename_all = "snake_case")]
        $vis enum $name {
            $( $(#[$vdoc])* $variant ),+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [Self] = &[$(Self::$variant),+];

            /// The name used in PostgreSQL, on the wire and in logs.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $text),+
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl std::str::FromStr for $name {
            type Err = $crate::ParseError;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s {
                    $($text => Ok(Self::$variant),)+
                    other => Err($crate::ParseError::new(
                        $what,
                        format!("unknown value {other:?}"),
                    )),
                }
            }
        }
    };
}

pub(crate) use text_enum;
