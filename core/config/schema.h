// The configuration schema: every key the trainer understands, with its type, default, allowed
// values and one line of documentation. The schema is data, defined in one place (schema.cpp);
// validation (config.cpp), typed access, `trainer --help` and the README reference are all derived
// from it, so adding a key means adding one entry there.
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

  std::string section() const;  // "train" for "train.lr"
  std::string name() const;     // "lr" for "train.lr"
};

struct SchemaSection {
  std::string name;
  std::string doc;
  bool open;  // open sections accept any keys and values, unvalidated (e.g. a plugin's own settings)
};

// All sections, in documentation order.
const std::vector<SchemaSection>& config_sections();
// All keys, grouped by section in the order of config_sections().
const std::vector<SchemaEntry>& config_schema();

// Look-ups; nullptr when absent.
const SchemaSection* find_config_section(const std::string& name);
const SchemaEntry* find_config_key(const std::string& key);

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
std::string render_help();
// Markdown reference: one table per section, for the README.
std::string render_markdown_reference();

}  // namespace weft
