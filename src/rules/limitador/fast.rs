//! The expressions Kuadrant writes, answered without the CEL interpreter:
//! a descriptor's entry (`descriptors[0]['user']`, `descriptors[0].user`),
//! and an entry compared with a string (`descriptors[0]['m'] == 'GET'`,
//! `!=`). Recognised from the compiled expression's syntax tree, so any
//! spelling CEL reads the same way is recognised too; each answer (value,
//! missing key, index out of bounds) is the one `cel::Program::execute`
//! gives, in the same form, so what follows from it cannot tell them
//! apart (the tests compare both on every shape).

use std::sync::Arc;

use cel::common::{
    ast::{Expr, operators},
    value::CelVal,
};

/// An expression answered without the interpreter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Fast {
    /// Entry `key` of descriptor `index`.
    Entry(Lookup),
    /// Entry `key` of descriptor `index` compared with `literal`: `==`
    /// when `equal`, else `!=`.
    Compare { lookup: Lookup, literal: String, equal: bool },
}

/// Entry `key` of descriptor `index`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Lookup {
    index: usize,
    /// The index was written unsigned (`0u`): an out-of-bounds error names it so.
    unsigned: bool,
    key: String,
}

impl Fast {
    /// The fast form of `e`, if it has one.
    pub(super) fn of(e: &cel::IdedExpr) -> Option<Self> {
        if let Expr::Call(call) = &e.expr
            && call.target.is_none()
            && call.args.len() == 2
            && (call.func_name == operators::EQUALS || call.func_name == operators::NOT_EQUALS)
        {
            let equal = call.func_name == operators::EQUALS;
            let (lookup, literal) = match (lookup(&call.args[0]), lookup(&call.args[1])) {
                (Some(lookup), None) => (lookup, string(&call.args[1])?),
                (None, Some(lookup)) => (lookup, string(&call.args[0])?),
                _ => return None,
            };
            return Some(Fast::Compare { lookup, literal, equal });
        }
        lookup(e).map(Fast::Entry)
    }

    /// What `cel::Program::execute` answers for this expression over
    /// `descriptors` (each a list of key and value; a repeated key's last
    /// value is the one a CEL map keeps).
    pub(super) fn execute(
        &self,
        descriptors: &[Vec<(&str, &str)>],
    ) -> Result<cel::Value, cel::ExecutionError> {
        match self {
            Fast::Entry(lookup) => Ok(cel::Value::String(Arc::new(lookup.find(descriptors)?.to_owned()))),
            Fast::Compare { lookup, literal, equal } => {
                Ok(cel::Value::Bool((lookup.find(descriptors)? == literal) == *equal))
            }
        }
    }
}

impl Lookup {
    fn find<'d>(&self, descriptors: &'d [Vec<(&str, &'d str)>]) -> Result<&'d str, cel::ExecutionError> {
        let Some(entries) = descriptors.get(self.index) else {
            let index = if self.unsigned {
                cel::Value::UInt(self.index as u64)
            } else {
                cel::Value::Int(i64::try_from(self.index).unwrap_or(i64::MAX))
            };
            return Err(cel::ExecutionError::IndexOutOfBounds(index));
        };
        entries
            .iter()
            .rev()
            .find(|(key, _)| *key == self.key)
            .map(|(_, value)| *value)
            .ok_or_else(|| cel::ExecutionError::no_such_key(&self.key))
    }
}

/// `descriptors[N]['key']` or `descriptors[N].key`.
fn lookup(e: &cel::IdedExpr) -> Option<Lookup> {
    let (operand, key) = match &e.expr {
        Expr::Call(call)
            if call.func_name == operators::INDEX && call.target.is_none() && call.args.len() == 2 =>
        {
            (&call.args[0], string(&call.args[1])?)
        }
        Expr::Select(select) if !select.test => (&*select.operand, select.field.clone()),
        _ => return None,
    };
    let Expr::Call(call) = &operand.expr else { return None };
    if call.func_name != operators::INDEX || call.target.is_some() || call.args.len() != 2 {
        return None;
    }
    if !matches!(&call.args[0].expr, Expr::Ident(name) if name == "descriptors") {
        return None;
    }
    let (index, unsigned) = match &call.args[1].expr {
        Expr::Literal(CelVal::Int(i)) => (usize::try_from(*i).ok()?, false),
        Expr::Literal(CelVal::UInt(u)) => (usize::try_from(*u).ok()?, true),
        _ => return None,
    };
    Some(Lookup { index, unsigned, key })
}

fn string(e: &cel::IdedExpr) -> Option<String> {
    match &e.expr {
        Expr::Literal(CelVal::String(s)) => Some(s.clone()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every shape answered as the interpreter answers it: the value, the
    /// boolean, a missing key, an index out of bounds (the same error),
    /// a repeated key, over requests of no, one and two descriptors.
    #[test]
    fn every_fast_form_answers_as_cel_does() {
        let sources = [
            "descriptors[0]['user']",
            "descriptors[0].user",
            "descriptors[1]['user']",
            "descriptors[0u]['user']",
            "descriptors[5u].user",
            "descriptors[0]['user'] == 'ann'",
            "'ann' == descriptors[0]['user']",
            "descriptors[0].user != 'ann'",
            "descriptors[0]['req.method'] == 'POST'",
            "descriptors[1]['a'] != \"x\"",
        ];
        let requests: [&[Vec<(&str, &str)>]; 4] = [
            &[],
            &[vec![("user", "ann"), ("req.method", "POST")]],
            &[vec![("user", "bob"), ("user", "ann")], vec![("a", "x")]],
            &[vec![("other", "1")], vec![("user", "cy"), ("a", "y")]],
        ];
        for source in sources {
            let program = cel::Program::compile(source).unwrap();
            let fast = Fast::of(program.expression()).unwrap_or_else(|| panic!("{source}: no fast form"));
            for descriptors in requests {
                let mut context = cel::Context::default();
                let list: Vec<cel::Value> = descriptors
                    .iter()
                    .map(|entries| {
                        let map: std::collections::HashMap<String, String> =
                            entries.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
                        cel::Value::from(map)
                    })
                    .collect();
                context.add_variable_from_value("descriptors", cel::Value::List(Arc::new(list)));
                let slow = program.execute(&context).map_err(|e| e.to_string());
                let quick = fast.execute(descriptors).map_err(|e| e.to_string());
                assert_eq!(quick, slow, "{source} over {descriptors:?}");
            }
        }
    }

    /// What the interpreter keeps: anything else, or a negative index.
    #[test]
    fn other_expressions_have_no_fast_form() {
        for source in [
            "descriptors[0]['a'] == descriptors[0]['b']",
            "descriptors[-1]['a']",
            "descriptors[0]['a'] == 1",
            "descriptors[0]['a'].size() > 1",
            "limit.name == 'x'",
            "descriptors.exists(d, d.user == 'ann')",
            "has(descriptors[0].user)",
            "descriptors[0]['a'] == 'x' && descriptors[0]['b'] == 'y'",
            "descriptors[0][1]",
        ] {
            let program = cel::Program::compile(source).unwrap();
            assert_eq!(Fast::of(program.expression()), None, "{source}");
        }
    }
}
