//! Prices (`prices:` of a rule): what a request costs, in integer
//! micro-units of a currency, from the tokens it states and the model it
//! names, so a limit of unit `cost` is charged by the service and not by
//! each gateway's own arithmetic.
//!
//! A price is micro-units per million of a unit (`input_tokens: 2500000`
//! is $2.50 per million input tokens); a request costs the sum over the
//! units its model has a price for of `amount × price / 10^6`, rounded up
//! once, so no sum of small requests costs less than their total.

use std::{collections::BTreeMap, collections::HashMap, sync::Arc};

use serde::{Deserialize, Serialize};

/// The unit a price table charges.
pub const COST: &str = "cost";

/// The largest price accepted, per million of a unit: a million units
/// of the currency (10^12 micro-units).
pub const MAX_PRICE: u64 = 1_000_000_000_000;

/// Most models in one price table.
pub const MAX_MODELS: usize = 1_024;

/// A rule's `prices:` as written.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawPrices {
    /// The request header that names the model (`x-model`).
    pub model_from: String,
    /// Per model, per unit: micro-units of the currency per million units.
    pub per_million: BTreeMap<String, BTreeMap<String, u64>>,
    /// A model the table does not list: `refuse` (the default: a `Check`
    /// is refused with NO_PRICE, a `Report` charged the table's highest
    /// price of each unit), or a listed model whose prices it is charged.
    #[serde(default = "refuse", skip_serializing_if = "is_refuse")]
    pub unpriced: String,
}

fn refuse() -> String {
    "refuse".to_owned()
}

fn is_refuse(value: &String) -> bool {
    value == "refuse"
}

/// A price table, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prices {
    /// The header naming the model, lower-case.
    header: String,
    /// Each model's prices, per unit.
    models: HashMap<String, Vec<(Arc<str>, u64)>>,
    /// What an unlisted model is charged: a listed model's prices, or
    /// (`None`: refuse) the highest price of each unit.
    unpriced: Option<String>,
    /// The highest price of each unit over the table.
    highest: Vec<(Arc<str>, u64)>,
    /// The table as written, for the rules' version and records.
    raw: RawPrices,
}

/// What a request costs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cost {
    /// Micro-units of the currency.
    Priced(u64),
    /// The model is not in the table and the table refuses it.
    Unpriced,
}

impl Prices {
    /// The table `raw`, checked; an error names the field under `prices`.
    pub fn new(raw: &RawPrices, unit_ok: impl Fn(&str) -> bool) -> Result<Self, (String, String)> {
        let at = |field: &str| format!("prices.{field}");
        let Some(header) = super::headers::header_name(&raw.model_from) else {
            return Err((at("model_from"), format!("{:?} is not a header name", raw.model_from)));
        };
        if raw.per_million.is_empty() || raw.per_million.len() > MAX_MODELS {
            return Err((at("per_million"), format!("list 1 to {MAX_MODELS} models")));
        }
        let mut models = HashMap::with_capacity(raw.per_million.len());
        let mut highest: BTreeMap<&str, u64> = BTreeMap::new();
        for (model, prices) in &raw.per_million {
            let mut units = Vec::with_capacity(prices.len());
            for (unit, &price) in prices {
                let field = at(&format!("per_million.{model}.{unit}"));
                if unit == COST || unit == "requests" || !unit_ok(unit) {
                    return Err((field, format!("{unit:?} is not a unit a price applies to")));
                }
                if price > MAX_PRICE {
                    return Err((field, format!("at most {MAX_PRICE} micro-units per million")));
                }
                units.push((Arc::from(unit.as_str()), price));
                let top = highest.entry(unit).or_default();
                *top = (*top).max(price);
            }
            models.insert(model.clone(), units);
        }
        let unpriced = match raw.unpriced.as_str() {
            "refuse" => None,
            model if raw.per_million.contains_key(model) => Some(model.to_owned()),
            other => {
                let message = format!("{other:?}: `refuse`, or a model of prices.per_million");
                return Err((at("unpriced"), message));
            }
        };
        let highest = highest.into_iter().map(|(unit, price)| (Arc::from(unit), price)).collect();
        Ok(Prices { header, models, unpriced, highest, raw: raw.clone() })
    }

    /// The table as written.
    pub fn raw(&self) -> &RawPrices {
        &self.raw
    }

    /// What a request naming its model in `headers` costs for the units
    /// `amount` gives (`None`: not stated); `report`: a report of usage,
    /// which an unlisted model never keeps from being charged.
    pub fn cost(
        &self,
        headers: &HashMap<String, String>,
        amount: impl Fn(&str) -> Option<u64>,
        report: bool,
    ) -> Cost {
        let model = super::headers::header(headers, &self.header).and_then(|model| self.models.get(model));
        let prices = match (model, &self.unpriced, report) {
            (Some(prices), _, _) => prices,
            (None, Some(default), _) => &self.models[default.as_str()],
            (None, None, true) => &self.highest,
            (None, None, false) => return Cost::Unpriced,
        };
        let micro_millions: u128 = prices
            .iter()
            .map(|(unit, price)| u128::from(amount(unit).unwrap_or(0)) * u128::from(*price))
            .sum();
        Cost::Priced(u64::try_from(micro_millions.div_ceil(1_000_000)).unwrap_or(u64::MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(unpriced: &str) -> Prices {
        let text = format!(
            "model_from: X-Model\nunpriced: {unpriced}\nper_million:\n  gpt-4o: {{ input_tokens: 2500000, output_tokens: 10000000, cached_input_tokens: 1250000 }}\n  mini: {{ input_tokens: 150000, output_tokens: 600000 }}\n"
        );
        Prices::new(&yaml_serde::from_str(&text).unwrap(), |_| true).unwrap()
    }

    #[test]
    fn a_request_costs_its_tokens_at_its_models_prices_rounded_up_once() {
        let prices = table("refuse");
        let usage =
            HashMap::from([("input_tokens", 1_200u64), ("output_tokens", 312), ("cached_input_tokens", 800)]);
        let amount = |unit: &str| usage.get(unit).copied();
        let headers = |model: &str| HashMap::from([("x-model".to_owned(), model.to_owned())]);
        // 1200 x 2.5 + 312 x 10 + 800 x 1.25 = 3000 + 3120 + 1000 micro-dollars.
        assert_eq!(prices.cost(&headers("gpt-4o"), amount, false), Cost::Priced(7_120));
        // 1200 x 0.15 + 312 x 0.6 = 180 + 187.2: rounded up once.
        assert_eq!(prices.cost(&headers("mini"), amount, false), Cost::Priced(368));
        assert_eq!(prices.cost(&headers("llama"), amount, false), Cost::Unpriced);
        assert_eq!(prices.cost(&HashMap::new(), amount, false), Cost::Unpriced);
        // A report of an unlisted model: the highest price of each unit.
        assert_eq!(prices.cost(&headers("llama"), amount, true), Cost::Priced(7_120));
        assert_eq!(table("mini").cost(&headers("llama"), amount, false), Cost::Priced(368));
        // Two spellings of the header naming two models: neither is believed.
        let two = HashMap::from([
            ("x-model".to_owned(), "mini".to_owned()),
            ("X-Model".to_owned(), "gpt-4o".to_owned()),
        ]);
        assert_eq!(prices.cost(&two, amount, false), Cost::Unpriced);
        let same = HashMap::from([
            ("x-model".to_owned(), "mini".to_owned()),
            ("X-MODEL".to_owned(), "mini".to_owned()),
        ]);
        assert_eq!(prices.cost(&same, amount, false), Cost::Priced(368));
        let huge = |_: &str| Some(u64::MAX);
        assert_eq!(prices.cost(&headers("gpt-4o"), huge, false), Cost::Priced(u64::MAX));
    }

    #[test]
    fn a_table_is_checked_field_by_field() {
        let check = |text: &str| {
            Prices::new(&yaml_serde::from_str(text).unwrap(), |unit| !unit.contains('!'))
                .map(|_| ())
                .unwrap_err()
        };
        let e = check("model_from: 'x model'\nper_million: { a: { input_tokens: 1 } }\n");
        assert_eq!(e.0, "prices.model_from");
        assert_eq!(check("model_from: x\nper_million: {}\n").0, "prices.per_million");
        let e = check("model_from: x\nper_million: { a: { cost: 1 } }\n");
        assert_eq!(e.0, "prices.per_million.a.cost");
        let e = check("model_from: x\nper_million: { a: { 'in!': 1 } }\n");
        assert_eq!(e.0, "prices.per_million.a.in!");
        let e = check("model_from: x\nper_million: { a: { input_tokens: 1000000000001 } }\n");
        assert!(e.1.contains("at most"), "{e:?}");
        let e = check("model_from: x\nunpriced: b\nper_million: { a: { input_tokens: 1 } }\n");
        assert_eq!(e.0, "prices.unpriced");
    }
}
