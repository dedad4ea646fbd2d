//! A YAML node tree that remembers where every node came from.
//!
//! Why this and not `serde_yaml_ng` alone: serde's data model has no place
//! for source positions, so after deserialisation a value no longer knows
//! its line and column, and most of our errors are semantic ("guarantee above
//! the pool's capacity", "two policies select the same jobs") and found after
//! deserialisation. We therefore parse with `saphyr-parser` (the maintained
//! successor of `yaml-rust`/`yaml-rust2`: pure Rust, YAML 1.2, no `unsafe`
//! C port, two small dependencies) whose events carry spans, build this small
//! tree, deserialise from it with our own serde `Deserializer` (see `de.rs`)
//! and look positions up by path for semantic errors.
//!
//! The tree also enforces what YAML parsers usually let through: duplicate
//! keys are refused, keys must be scalars, and aliases are expanded with a
//! bound so that a "billion laughs" document cannot exhaust memory.

use std::collections::BTreeMap;

use saphyr_parser::{Event, Parser, ScalarStyle, Span, Tag};

/// Most nodes a stream of policies may expand to (aliases included).
const MAX_NODES: usize = 100_000;
/// Most nodes a `sluicectl simulate` scenario may expand to: about 150,000
/// jobs with a label or two each, read on the operator's own machine.
pub const MAX_SCENARIO_NODES: usize = 2_000_000;
/// Deepest nesting accepted.
const MAX_DEPTH: usize = 64;

/// A 1-based line and column (in characters) in the source text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Pos {
    /// Line, starting at 1.
    pub line: u32,
    /// Column in characters, starting at 1.
    pub column: u32,
}

impl Pos {
    fn of(span: &Span) -> Self {
        Self {
            line: u32::try_from(span.start.line()).unwrap_or(u32::MAX),
            column: u32::try_from(span.start.col() + 1).unwrap_or(u32::MAX),
        }
    }
}

/// One node of a parsed document.
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    /// Where the node starts.
    pub at: Pos,
    /// What it holds.
    pub value: Value,
}

/// The value of a [`Node`].
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// A scalar; `plain` is false for quoted and block scalars, which are
    /// always strings.
    Scalar { text: String, plain: bool },
    /// A sequence.
    Seq(Vec<Node>),
    /// A mapping, in source order, keys unique.
    Map(Vec<(Key, Node)>),
}

/// A mapping key.
#[derive(Debug, Clone, PartialEq)]
pub struct Key {
    /// Where the key starts.
    pub at: Pos,
    /// The key's text.
    pub text: String,
}

/// A plain scalar resolved with the YAML 1.2 core schema.
#[derive(Debug, Clone, PartialEq)]
pub enum Resolved<'a> {
    /// `~`, `null` or nothing.
    Null,
    /// `true` or `false`.
    Bool(bool),
    /// A whole number that fits an `i64`.
    Int(i64),
    /// Any other number.
    Float(f64),
    /// Everything else.
    Str(&'a str),
}

impl Node {
    /// Resolves a scalar's type (core schema); `None` for collections.
    pub fn resolve(&self) -> Option<Resolved<'_>> {
        let Value::Scalar { text, plain } = &self.value else {
            return None;
        };
        if !plain {
            return Some(Resolved::Str(text));
        }
        Some(resolve_plain(text))
    }

    /// Returns the value of `key` when this node is a mapping that has it.
    pub fn get(&self, key: &str) -> Option<&Node> {
        self.entry(key).map(|(_, v)| v)
    }

    /// Returns the key and value of `key` when this node is a mapping.
    pub fn entry(&self, key: &str) -> Option<(&Key, &Node)> {
        match &self.value {
            Value::Map(entries) => entries
                .iter()
                .find(|(k, _)| k.text == key)
                .map(|(k, v)| (k, v)),
            _ => None,
        }
    }

    /// Follows `path` (mapping keys, or sequence indices written as
    /// numbers) as far as it exists; returns the deepest node reached and
    /// whether the whole path was found.
    fn walk(&self, path: &[&str]) -> (&Node, bool) {
        let mut node = self;
        for step in path {
            let next = match &node.value {
                Value::Map(_) => node.get(step),
                Value::Seq(items) => step.parse::<usize>().ok().and_then(|i| items.get(i)),
                Value::Scalar { .. } => None,
            };
            match next {
                Some(n) => node = n,
                None => return (node, false),
            }
        }
        (node, true)
    }

    /// Returns the position of the node at `path`, or of the deepest
    /// ancestor of it that exists.
    pub fn locate(&self, path: &[&str]) -> Pos {
        self.walk(path).0.at
    }

    /// Returns the position of `key` itself (`value: false`) or of its
    /// value (`value: true`) in the mapping at `path`, or the best
    /// position [`Node::locate`] finds. Unlike a dotted path, `key` may
    /// contain dots (`example.com/team`).
    pub fn locate_entry(&self, path: &[&str], key: &str, value: bool) -> Pos {
        match self.walk(path) {
            (node, true) => node
                .entry(key)
                .map_or(node.at, |(k, v)| if value { v.at } else { k.at }),
            (node, false) => node.at,
        }
    }

    /// True for a null scalar (an empty document, `~`, `null`).
    pub fn is_null(&self) -> bool {
        matches!(self.resolve(), Some(Resolved::Null))
    }
}

fn resolve_plain(text: &str) -> Resolved<'_> {
    match text {
        "" | "~" | "null" | "Null" | "NULL" => return Resolved::Null,
        "true" | "True" | "TRUE" => return Resolved::Bool(true),
        "false" | "False" | "FALSE" => return Resolved::Bool(false),
        ".inf" | ".Inf" | ".INF" | "+.inf" | "+.Inf" | "+.INF" => {
            return Resolved::Float(f64::INFINITY);
        }
        "-.inf" | "-.Inf" | "-.INF" => return Resolved::Float(f64::NEG_INFINITY),
        ".nan" | ".NaN" | ".NAN" => return Resolved::Float(f64::NAN),
        _ => {}
    }
    let unsigned = text.strip_prefix(['-', '+']).unwrap_or(text);
    if !unsigned.is_empty() && unsigned.bytes().all(|b| b.is_ascii_digit()) {
        return text
            .parse::<i64>()
            .map(Resolved::Int)
            .unwrap_or_else(|_| Resolved::Float(text.parse().unwrap_or(f64::INFINITY)));
    }
    for (prefix, radix) in [("0x", 16), ("0o", 8)] {
        if let Some(digits) = text.strip_prefix(prefix)
            && let Ok(v) = i64::from_str_radix(digits, radix)
        {
            return Resolved::Int(v);
        }
    }
    if is_float(text)
        && let Ok(v) = text.parse::<f64>()
    {
        return Resolved::Float(v);
    }
    Resolved::Str(text)
}

/// `[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?`
fn is_float(text: &str) -> bool {
    let t = text.strip_prefix(['-', '+']).unwrap_or(text);
    let (mantissa, exponent) = match t.find(['e', 'E']) {
        Some(i) => (&t[..i], Some(&t[i + 1..])),
        None => (t, None),
    };
    let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    let mantissa_ok =
        digits(whole) && digits(fraction) && !(whole.is_empty() && fraction.is_empty());
    let exponent_ok = exponent.is_none_or(|e| {
        let e = e.strip_prefix(['-', '+']).unwrap_or(e);
        !e.is_empty() && digits(e)
    });
    mantissa_ok && exponent_ok
}

/// Why a stream could not be turned into nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyntaxError {
    /// Where the problem was found.
    pub at: Pos,
    /// What the problem is (lowercase, no position).
    pub reason: String,
}

/// Parses every document of a YAML stream. Empty documents (nothing, or
/// only comments) are left out; each returned node is paired with the
/// position of its document's start.
pub fn parse_stream(text: &str) -> Result<Vec<Node>, SyntaxError> {
    parse_stream_within(text, MAX_NODES)
}

/// [`parse_stream`] for a stream that may expand to `max_nodes` nodes.
pub fn parse_stream_within(text: &str, max_nodes: usize) -> Result<Vec<Node>, SyntaxError> {
    let mut builder = Builder {
        max_nodes,
        ..Builder::default()
    };
    for event in Parser::new_from_str(text) {
        let (event, span) = event.map_err(|e| SyntaxError {
            at: Pos {
                line: u32::try_from(e.marker().line()).unwrap_or(u32::MAX),
                column: u32::try_from(e.marker().col() + 1).unwrap_or(u32::MAX),
            },
            reason: e.info().to_owned(),
        })?;
        builder.event(event, &span)?;
    }
    Ok(builder.documents)
}

/// A collection being built.
enum Open {
    Seq {
        at: Pos,
        anchor: usize,
        items: Vec<Node>,
    },
    Map {
        at: Pos,
        anchor: usize,
        entries: Vec<(Key, Node)>,
        key: Option<Key>,
    },
}

#[derive(Default)]
struct Builder {
    stack: Vec<Open>,
    anchors: BTreeMap<usize, Node>,
    documents: Vec<Node>,
    nodes: usize,
    max_nodes: usize,
}

impl Builder {
    fn event(&mut self, event: Event<'_>, span: &Span) -> Result<(), SyntaxError> {
        let at = Pos::of(span);
        match event {
            Event::DocumentStart(_) => self.anchors.clear(),
            Event::Scalar(text, style, anchor, tag) => {
                let plain = style == ScalarStyle::Plain && !tag.as_deref().is_some_and(is_str_tag);
                if let Some(tag) = tag.as_deref() {
                    check_tag(tag, at)?;
                }
                let node = Node {
                    at,
                    value: Value::Scalar {
                        text: text.into_owned(),
                        plain,
                    },
                };
                self.finish(node, anchor)?;
            }
            Event::SequenceStart(anchor, ref tag) | Event::MappingStart(anchor, ref tag) => {
                if let Some(tag) = tag.as_deref() {
                    check_tag(tag, at)?;
                }
                if self.stack.len() >= MAX_DEPTH {
                    return Err(SyntaxError {
                        at,
                        reason: format!("the document nests deeper than {MAX_DEPTH} levels"),
                    });
                }
                let is_seq = matches!(event, Event::SequenceStart(..));
                self.stack.push(if is_seq {
                    Open::Seq {
                        at,
                        anchor,
                        items: Vec::new(),
                    }
                } else {
                    Open::Map {
                        at,
                        anchor,
                        entries: Vec::new(),
                        key: None,
                    }
                });
            }
            Event::SequenceEnd | Event::MappingEnd => {
                let (node, anchor) = match self.stack.pop() {
                    Some(Open::Seq { at, anchor, items }) => (
                        Node {
                            at,
                            value: Value::Seq(items),
                        },
                        anchor,
                    ),
                    Some(Open::Map {
                        at,
                        anchor,
                        entries,
                        ..
                    }) => (
                        Node {
                            at,
                            value: Value::Map(entries),
                        },
                        anchor,
                    ),
                    None => return Ok(()),
                };
                self.finish(node, anchor)?;
            }
            Event::Alias(id) => {
                let Some(node) = self.anchors.get(&id).cloned() else {
                    return Err(SyntaxError {
                        at,
                        reason: "alias to an unknown anchor".into(),
                    });
                };
                self.nodes += count(&node);
                self.place(Node { at, ..node })?;
            }
            Event::StreamStart | Event::StreamEnd | Event::DocumentEnd | Event::Nothing => {}
        }
        Ok(())
    }

    /// Records a completed node under its anchor and places it.
    fn finish(&mut self, node: Node, anchor: usize) -> Result<(), SyntaxError> {
        self.nodes += 1;
        if anchor > 0 {
            self.anchors.insert(anchor, node.clone());
        }
        self.place(node)
    }

    /// Puts a completed node where it belongs: a document, a sequence
    /// item, a mapping key or a mapping value.
    fn place(&mut self, node: Node) -> Result<(), SyntaxError> {
        if self.nodes > self.max_nodes {
            return Err(SyntaxError {
                at: node.at,
                reason: format!(
                    "the document expands to more than {} nodes (aliases included): split it",
                    self.max_nodes
                ),
            });
        }
        match self.stack.last_mut() {
            None => {
                if !node.is_null() {
                    self.documents.push(node);
                }
            }
            Some(Open::Seq { items, .. }) => items.push(node),
            Some(Open::Map { entries, key, .. }) => match key.take() {
                None => {
                    let Value::Scalar { text, .. } = node.value else {
                        return Err(SyntaxError {
                            at: node.at,
                            reason: "a mapping key must be a plain word, not a list or mapping"
                                .into(),
                        });
                    };
                    if let Some((first, _)) = entries.iter().find(|(k, _)| k.text == text) {
                        return Err(SyntaxError {
                            at: node.at,
                            reason: format!(
                                "duplicate key `{text}` (first at line {}, column {}): each key may appear once in a mapping",
                                first.at.line, first.at.column
                            ),
                        });
                    }
                    *key = Some(Key { at: node.at, text });
                }
                Some(k) => {
                    // An empty value has no text to point at: point at its key.
                    let empty = matches!(&node.value, Value::Scalar { text, plain: true } if text.is_empty());
                    let at = if empty { k.at } else { node.at };
                    entries.push((k, Node { at, ..node }));
                }
            },
        }
        Ok(())
    }
}

fn count(node: &Node) -> usize {
    1 + match &node.value {
        Value::Scalar { .. } => 0,
        Value::Seq(items) => items.iter().map(count).sum(),
        Value::Map(entries) => entries.iter().map(|(_, v)| 1 + count(v)).sum(),
    }
}

fn is_str_tag(tag: &Tag) -> bool {
    tag.is_yaml_core_schema() && tag.suffix == "str"
}

/// Accepts the core-schema tags (`!!str`, `!!int`, `!!map`, ...) and
/// refuses application tags, which this language gives no meaning.
fn check_tag(tag: &Tag, at: Pos) -> Result<(), SyntaxError> {
    if tag.is_yaml_core_schema() {
        return Ok(());
    }
    Err(SyntaxError {
        at,
        reason: format!(
            "tag `{}{}` has no meaning in a policy: remove it",
            tag.handle, tag.suffix
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(text: &str) -> Node {
        let mut docs = parse_stream(text).unwrap();
        assert_eq!(docs.len(), 1, "{docs:?}");
        docs.remove(0)
    }

    #[test]
    fn positions_are_one_based() {
        let doc = one("a: 1\nb:\n  c: 'x'\n  d: [1, 2]\n");
        assert_eq!(doc.get("a").unwrap().at, Pos { line: 1, column: 4 });
        assert_eq!(doc.entry("b").unwrap().0.at, Pos { line: 2, column: 1 });
        assert_eq!(doc.locate(&["b", "c"]), Pos { line: 3, column: 6 });
        assert_eq!(
            doc.locate(&["b", "d", "1"]),
            Pos {
                line: 4,
                column: 10
            }
        );
        assert_eq!(
            doc.locate_entry(&["b"], "d", false),
            Pos { line: 4, column: 3 }
        );
        assert_eq!(
            doc.locate_entry(&["b"], "d", true),
            Pos { line: 4, column: 6 }
        );
        // A missing step stops at the deepest node that exists.
        assert_eq!(doc.locate(&["b", "zz", "y"]), doc.get("b").unwrap().at);
    }

    #[test]
    fn scalars_resolve_with_the_core_schema() {
        let doc = one(
            "a: 12\nb: '12'\nc: true\nd: yes\ne: 1.5\nf: ~\ng: 0x1f\nh: 800MiB/s\ni: !!str 7\nj: 1e3\n",
        );
        let r = |k: &str| doc.get(k).unwrap().resolve().unwrap();
        assert_eq!(r("a"), Resolved::Int(12));
        assert_eq!(r("b"), Resolved::Str("12"));
        assert_eq!(r("c"), Resolved::Bool(true));
        // YAML 1.2: `yes` is a string, not a boolean.
        assert_eq!(r("d"), Resolved::Str("yes"));
        assert_eq!(r("e"), Resolved::Float(1.5));
        assert_eq!(r("f"), Resolved::Null);
        assert_eq!(r("g"), Resolved::Int(31));
        assert_eq!(r("h"), Resolved::Str("800MiB/s"));
        assert_eq!(r("i"), Resolved::Str("7"));
        assert_eq!(r("j"), Resolved::Float(1000.0));
    }

    #[test]
    fn empty_documents_are_skipped() {
        assert!(parse_stream("").unwrap().is_empty());
        assert!(
            parse_stream("# only a comment\n---\n---\n")
                .unwrap()
                .is_empty()
        );
        assert_eq!(
            parse_stream("a: 1\n---\n# nothing\n---\nb: 2\n")
                .unwrap()
                .len(),
            2
        );
    }

    #[test]
    fn duplicate_keys_are_refused() {
        let err = parse_stream("a: 1\nb: 2\na: 3\n").unwrap_err();
        assert_eq!(err.at, Pos { line: 3, column: 1 });
        assert!(
            err.reason
                .contains("duplicate key `a` (first at line 1, column 1)"),
            "{}",
            err.reason
        );
    }

    #[test]
    fn syntax_errors_have_positions() {
        let err = parse_stream("a: 1\nb: [1, 2\n").unwrap_err();
        assert!(err.at.line >= 2, "{err:?}");
        let err = parse_stream("a: 1\n  b: 2\n").unwrap_err();
        assert_eq!(err.at.line, 2, "{err:?}");
    }

    #[test]
    fn aliases_expand_within_bounds() {
        let doc = one("a: &x {b: 1}\nc: *x\n");
        assert_eq!(
            doc.get("c").unwrap().get("b").unwrap().resolve(),
            Some(Resolved::Int(1))
        );
        let mut bomb = String::from("a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n");
        for i in 1..9 {
            let p = i - 1;
            bomb.push_str(&format!(
                "a{i}: &a{i} [*a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}]\n"
            ));
        }
        let err = parse_stream(&bomb).unwrap_err();
        assert!(err.reason.contains("more than"), "{err:?}");
    }

    #[test]
    fn application_tags_are_refused() {
        let err = parse_stream("a: !custom 1\n").unwrap_err();
        assert!(err.reason.contains("tag `!custom`"), "{err:?}");
    }

    #[test]
    fn json_is_yaml() {
        let doc = one(r#"{"a": {"b": [1, "2"]}}"#);
        assert_eq!(
            doc.locate(&["a", "b", "1"]),
            Pos {
                line: 1,
                column: 17
            }
        );
    }
}
