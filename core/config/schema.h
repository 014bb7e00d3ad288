// A configuration schema: sections and keys, each key with its type, default, allowed values and
// one line of documentation. Config (config.h) validates against a Schema and reads through it;
// render_help and render_markdown_reference document it. weft's own schema, declared once per key
// next to the option each key sets, is run_schema() (core/job/options.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace weft {

enum class ValueType { Int, Float, Bool, String, StringList };

// A typed configuration value. Float keys always hold double (an integer written for a float key is
// converted), string_list keys always hold std::vector<std::string>.
using ConfigValue = std::variant<int64_t, double, bool, std::string, std::vector<std::string>>;

struct SchemaEntry {
  std::string key;                   // "section.name"
  ValueType type;
  ConfigValue default_value;         // holds the alternative matching `type`
  std::string doc;                   // one line
  std::vector<std::string> choices;  // String keys only; empty = any string
  std::optional<double> min;         // Int/Float keys only, inclusive
  std::optional<double> max;         // Int/Float keys only, inclusive
  bool min_exclusive = false;        // the value must be greater than min (not equal)
  bool max_exclusive = false;        // the value must be less than max (not equal)
  // A default the run decides (e.g. from the checkpoint), shown in the docs instead of
  // default_value; the key's consumer sees whether it was set (Config::is_set).
  std::string default_text{};

  std::string section() const;  // "train" for "train.lr"
  std::string name() const;     // "lr" for "train.lr"
};

struct SchemaSection {
  std::string name;
  std::string doc;
  bool open;  // open sections accept any keys and values, unvalidated (e.g. a plugin's own settings)
};

struct Schema {
  std::vector<SchemaSection> sections;  // in documentation order
  std::vector<SchemaEntry> entries;     // grouped by section, in the order of `sections`

  // Look-ups; nullptr when absent.
  const SchemaSection* find_section(const std::string& name) const;
  const SchemaEntry* find_key(const std::string& key) const;
};

// "an integer", "a float", "a boolean", "a string", "a list of strings".
std::string describe_type(ValueType type);
// Short type name for documentation: "int", "float", "bool", "string", "string list".
std::string type_name(ValueType type);
// The allowed range of an Int/Float entry: ">= 1", "between 0 and 1" (inclusive), "> 0 and <= 1";
// empty when unbounded.
std::string describe_range(const SchemaEntry& entry);
// A value written as TOML (strings quoted and escaped, floats round-trip exactly, lists inline).
std::string value_to_toml(const ConfigValue& value);

// Plain-text reference of every key (type, default, choices, range, doc), grouped by section;
// printed by `trainer --help`.
std::string render_help(const Schema& schema);
// Markdown reference: one table per section (docs/configuration.md).
std::string render_markdown_reference(const Schema& schema);

}  // namespace weft
