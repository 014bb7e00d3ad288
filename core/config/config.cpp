#include "core/config/config.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <stdexcept>

#include <fmt/format.h>

#include "core/util/error.h"
#include "core/util/hash.h"
#include "core/util/suggest.h"

namespace weft {
namespace fs = std::filesystem;
using Origins = std::map<std::string, std::string>;

namespace {

// ---- suggestions (closest: core/util/suggest.h) -------------------------------------------

// Suggests a schema key for an unknown one: a close name in the same section, else the same or a
// close name in any section ("train.seq_len" -> "data.seq_len", top-level "lr" -> "train.lr").
std::optional<std::string> suggest_key(const Schema& schema, const std::string& section, const std::string& name) {
  std::vector<std::string> same_section, everywhere;
  for (const auto& entry : schema.entries) {
    if (entry.section() == section) same_section.push_back(entry.name());
    everywhere.push_back(entry.name());
  }
  if (auto match = closest(name, same_section)) return section + "." + *match;
  if (auto match = closest(name, everywhere))
    for (const auto& entry : schema.entries)
      if (entry.name() == *match) return entry.key;
  return std::nullopt;
}

std::string did_you_mean(const std::optional<std::string>& suggestion) {
  return suggestion ? fmt::format("; did you mean '{}'?", *suggestion) : "";
}

// ---- reading files -----------------------------------------------------------------------------

std::string read_text_file(const std::string& path, const std::string& context) {
  std::error_code ec;  // a name the file system refuses (too long) is an error, not an exception
  const auto status = fs::status(path, ec);
  WEFT_CHECK(!ec || ec == std::errc::no_such_file_or_directory, "config file '{}': {}{}", path, ec.message(), context);
  WEFT_CHECK(fs::exists(status), "config file '{}' not found{}", path, context);
  WEFT_CHECK(!fs::is_directory(status), "config file '{}' is a directory{}", path, context);
  std::ifstream in(path, std::ios::binary);
  WEFT_CHECK(in, "cannot read config file '{}'{}", path, context);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

toml::table parse_toml(const std::string& text, const std::string& name) {
  try {
    return toml::parse(text, name);
  } catch (const toml::parse_error& e) {
    fail("{}:{}:{}: TOML syntax error: {}", name, e.source().begin.line, e.source().begin.column,
         e.description());
  }
}

std::string location(const std::string& file, const toml::node& node) {
  return fmt::format("{}:{}", file, node.source().begin.line);
}

void record_origins(const toml::table& table, const std::string& prefix, const std::string& file,
                    Origins& origins) {
  for (auto&& [key, node] : table) {
    const std::string path = prefix.empty() ? std::string(key.str()) : prefix + "." + std::string(key.str());
    origins[path] = location(file, node);
    if (const toml::table* sub = node.as_table()) record_origins(*sub, path, file, origins);
  }
}

// Merges `over` into `base`: tables merge key by key, any other value replaces.
void deep_merge(toml::table& base, const toml::table& over) {
  for (auto&& [key, node] : over) {
    toml::table* base_sub = base.get_as<toml::table>(key.str());
    const toml::table* over_sub = node.as_table();
    if (base_sub && over_sub)
      deep_merge(*base_sub, *over_sub);
    else
      base.insert_or_assign(key, node);
  }
}

struct Layered {
  toml::table table;
  Origins origins;
  std::vector<std::string> files;  // base first
};

// One file of an extends chain: `stack` holds the canonical paths and display names of the files
// that extend this one, to detect cycles.
Layered load_layer(const std::string& text, const std::string& name,
                   std::vector<std::pair<fs::path, std::string>>& stack) {
  Layered own;
  own.table = parse_toml(text, name);
  record_origins(own.table, "", name, own.origins);
  own.files = {name};
  const toml::node* extends = own.table.get("extends");
  if (!extends) return own;

  const std::string where = location(name, *extends);
  const auto* base_path = extends->as_string();
  WEFT_CHECK(base_path, "config key 'extends' must be a string path ({})", where);
  const std::string base_name =
      (fs::path(name).parent_path() / base_path->get()).lexically_normal().string();
  own.table.erase("extends");
  own.origins.erase("extends");

  std::error_code ec;
  const fs::path canonical = fs::weakly_canonical(base_name, ec);
  WEFT_CHECK(!ec, "config key 'extends' names '{}': {} ({})", base_name, ec.message(), where);
  for (size_t i = 0; i < stack.size(); ++i) {
    if (stack[i].first != canonical) continue;
    std::string chain;
    for (size_t j = i; j < stack.size(); ++j) chain += stack[j].second + " -> ";
    fail("config extends cycle: {}{} ({})", chain, base_name, where);
  }
  const std::string base_text =
      read_text_file(base_name, fmt::format(" (extended by {})", where));
  stack.emplace_back(canonical, base_name);
  Layered result = load_layer(base_text, base_name, stack);
  stack.pop_back();

  deep_merge(result.table, own.table);
  for (auto& [path, origin] : own.origins) result.origins[path] = origin;
  result.files.push_back(name);
  return result;
}

// ---- overrides ---------------------------------------------------------------------------------

std::string trim(const std::string& s) {
  const size_t begin = s.find_first_not_of(" \t");
  if (begin == std::string::npos) return "";
  return s.substr(begin, s.find_last_not_of(" \t") - begin + 1);
}

std::vector<std::string> split_key(const std::string& key) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t dot = key.find('.', start);
    parts.push_back(trim(key.substr(start, dot - start)));
    if (dot == std::string::npos) return parts;
    start = dot + 1;
  }
}

// "[a, b]" with bare words (what a shell leaves of ["a","b"]) -> {"a", "b"}.
std::optional<toml::array> bare_word_list(const std::string& text) {
  if (text.size() < 2 || text.front() != '[' || text.back() != ']') return std::nullopt;
  toml::array list;
  std::stringstream items(text.substr(1, text.size() - 2));
  std::string item;
  while (std::getline(items, item, ','))
    if (!trim(item).empty()) list.push_back(trim(item));
  return list;
}

// The override value as a TOML node, held as the only entry "v" of a table.
toml::table parse_override_value(const std::string& text, const SchemaEntry* entry) {
  toml::table parsed;
  bool valid = false;
  try {
    parsed = toml::parse("v = " + text);
    valid = parsed.size() == 1 && parsed.contains("v");
  } catch (const toml::parse_error&) {
  }
  const bool wants_text =
      entry && (entry->type == ValueType::String || entry->type == ValueType::StringList);
  if (valid && !(wants_text && !parsed["v"].is_string() && !parsed["v"].is_array())) return parsed;
  toml::table as_text;
  if (entry && entry->type == ValueType::StringList && !valid)
    if (auto list = bare_word_list(text)) return toml::table{{"v", *list}};
  as_text.insert("v", text);
  return as_text;
}

void apply_override(const Schema& schema, const std::string& text, toml::table& root, Origins& origins) {
  const size_t equals = text.find('=');
  WEFT_CHECK(equals != std::string::npos, "malformed override '{}': expected section.key=value",
             text);
  const std::string key = trim(text.substr(0, equals));
  const std::vector<std::string> parts = split_key(key);
  const bool empty_part =
      std::any_of(parts.begin(), parts.end(), [](const std::string& p) { return p.empty(); });
  WEFT_CHECK(!key.empty() && !empty_part && parts.size() >= 2,
             "malformed override '{}': expected section.key=value", text);

  toml::table value = parse_override_value(trim(text.substr(equals + 1)), schema.find_key(key));
  toml::table* table = &root;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    if (!table->get_as<toml::table>(parts[i])) table->insert_or_assign(parts[i], toml::table{});
    table = table->get_as<toml::table>(parts[i]);
  }
  table->insert_or_assign(parts.back(), *value.get("v"));
  std::string path;
  for (const auto& part : parts) {
    path += (path.empty() ? "" : ".") + part;
    if (!origins.count(path) || path == key) origins[path] = "--set";
  }
}

// ---- validation --------------------------------------------------------------------------------

std::string node_kind(const toml::node& node) {
  switch (node.type()) {
    case toml::node_type::string: return "string";
    case toml::node_type::integer: return "integer";
    case toml::node_type::floating_point: return "float";
    case toml::node_type::boolean: return "boolean";
    case toml::node_type::array: return "array";
    case toml::node_type::table: return "table";
    case toml::node_type::date: return "date";
    case toml::node_type::time: return "time";
    case toml::node_type::date_time: return "date-time";
    default: return "value";
  }
}

// "string \"abc\"", "array [1, 2]", "table".
std::string describe_node(const toml::node& node) {
  if (node.is_table()) return "table";
  std::ostringstream text;
  text << toml::toml_formatter{node, toml::format_flags::none};
  return node_kind(node) + " " + text.str();
}

void check_range(const SchemaEntry& entry, double value, const std::string& shown,
                 const std::string& where) {
  const bool below = entry.min && (value < *entry.min || (entry.min_exclusive && value == *entry.min));
  const bool above = entry.max && (value > *entry.max || (entry.max_exclusive && value == *entry.max));
  if (!below && !above) return;
  fail("config key '{}' must be {}, got {} ({})", entry.key, describe_range(entry), shown, where);
}

void check_choice(const SchemaEntry& entry, const std::string& value, const std::string& where) {
  if (entry.choices.empty() ||
      std::find(entry.choices.begin(), entry.choices.end(), value) != entry.choices.end())
    return;
  std::string listed;
  for (const auto& choice : entry.choices)
    listed += (listed.empty() ? "" : ", ") + value_to_toml(ConfigValue(choice));
  fail("config key '{}' must be one of {}; got {} ({})", entry.key, listed,
       value_to_toml(ConfigValue(value)), where);
}

// Converts and checks one configured value; throws weft::Error naming the key and `where`.
ConfigValue to_config_value(const SchemaEntry& entry, const toml::node& node,
                            const std::string& where) {
  switch (entry.type) {
    case ValueType::Int:
      if (const auto* v = node.as_integer()) {
        check_range(entry, static_cast<double>(v->get()), std::to_string(v->get()), where);
        return v->get();
      }
      break;
    case ValueType::Float:
      if (node.is_number()) {
        const double v = node.is_integer() ? static_cast<double>(node.as_integer()->get())
                                           : node.as_floating_point()->get();
        WEFT_CHECK(std::isfinite(v), "config key '{}' must be a finite number, got {} ({})",
                   entry.key, describe_node(node), where);
        check_range(entry, v, value_to_toml(ConfigValue(v)), where);
        return v;
      }
      break;
    case ValueType::Bool:
      if (const auto* v = node.as_boolean()) return v->get();
      break;
    case ValueType::String:
      if (const auto* v = node.as_string()) {
        check_choice(entry, v->get(), where);
        return v->get();
      }
      break;
    case ValueType::StringList:
      if (const auto* v = node.as_string()) return std::vector<std::string>{v->get()};
      if (const auto* list = node.as_array()) {
        std::vector<std::string> items;
        for (const auto& item : *list)
          if (const auto* s = item.as_string()) items.push_back(s->get());
        if (items.size() == list->size()) return items;
      }
      break;
  }
  fail("config key '{}' must be {}, got {} ({})", entry.key, describe_type(entry.type),
       describe_node(node), where);
}

std::string origin_of(const Origins& origins, const std::string& path) {
  const auto it = origins.find(path);
  return it == origins.end() ? "unknown origin" : it->second;
}

}  // namespace

// Builds a validated Config from the merged table (a friend of Config).
class ConfigBuilder {
 public:
  static Config build(const Schema& schema, const toml::table& root, Origins origins, std::vector<std::string> files) {
    Config config(schema);
    for (auto&& [key, node] : root) {
      const std::string name(key.str());
      const std::string where = origin_of(origins, name);
      const SchemaSection* section = schema.find_section(name);
      if (!section && node.is_table()) {
        std::vector<std::string> names;
        for (const auto& s : schema.sections) names.push_back(s.name);
        fail("unknown config section '{}' ({}){}", name, where, did_you_mean(closest(name, names)));
      }
      WEFT_CHECK(section, "unknown config key '{}' ({}){}", name, where,
                 did_you_mean(suggest_key(schema, "", name)));
      const toml::table* table = node.as_table();
      WEFT_CHECK(table, "config key '{}' must be a section (table), got {} ({})", name,
                 describe_node(node), where);
      if (section->open) {
        config.open_sections_.insert_or_assign(name, *table);
        continue;
      }
      for (auto&& [sub_key, value] : *table) {
        const std::string full = name + "." + std::string(sub_key.str());
        const std::string value_where = origin_of(origins, full);
        const SchemaEntry* entry = schema.find_key(full);
        WEFT_CHECK(entry, "unknown config key '{}' ({}){}", full, value_where,
                   did_you_mean(suggest_key(schema, name, std::string(sub_key.str()))));
        config.values_[full] = to_config_value(*entry, value, value_where);
      }
    }
    config.origins_ = std::move(origins);
    config.files_ = std::move(files);
    return config;
  }
};

namespace {

Config finish(const Schema& schema, Layered layered, const std::vector<std::string>& overrides) {
  for (const auto& text : overrides) apply_override(schema, text, layered.table, layered.origins);
  return ConfigBuilder::build(schema, layered.table, std::move(layered.origins), std::move(layered.files));
}

}  // namespace

Config load_config_text(const Schema& schema, const std::string& toml_text, const std::string& source_name,
                        const std::vector<std::string>& overrides) {
  std::error_code ec;
  const fs::path canonical = fs::weakly_canonical(source_name, ec);
  WEFT_CHECK(!ec, "config file '{}': {}", source_name, ec.message());
  std::vector<std::pair<fs::path, std::string>> stack{{canonical, source_name}};
  return finish(schema, load_layer(toml_text, source_name, stack), overrides);
}

Config load_config(const Schema& schema, const std::string& path, const std::vector<std::string>& overrides) {
  if (path.empty()) return finish(schema, Layered{}, overrides);
  return load_config_text(schema, read_text_file(path, ""), path, overrides);
}

// ---- Config ------------------------------------------------------------------------------------

const SchemaEntry& Config::entry_for(const std::string& key, ValueType type) const {
  const SchemaEntry* entry = schema_->find_key(key);
  if (!entry) throw std::logic_error("weft::Config: '" + key + "' is not a key of the schema");
  if (entry->type != type)
    throw std::logic_error("weft::Config: '" + key + "' is " + describe_type(entry->type) +
                           ", not " + describe_type(type));
  return *entry;
}

const ConfigValue& Config::value(const std::string& key) const {
  const SchemaEntry* entry = schema_->find_key(key);
  if (!entry) throw std::logic_error("weft::Config: '" + key + "' is not a key of the schema");
  const ConfigValue* set = explicit_value(key);
  return set ? *set : entry->default_value;
}

const ConfigValue* Config::explicit_value(const std::string& key) const {
  const auto it = values_.find(key);
  return it == values_.end() ? nullptr : &it->second;
}

int64_t Config::get_int(const std::string& key) const {
  const SchemaEntry& entry = entry_for(key, ValueType::Int);
  const ConfigValue* value = explicit_value(key);
  return std::get<int64_t>(value ? *value : entry.default_value);
}

double Config::get_float(const std::string& key) const {
  const SchemaEntry& entry = entry_for(key, ValueType::Float);
  const ConfigValue* value = explicit_value(key);
  return std::get<double>(value ? *value : entry.default_value);
}

bool Config::get_bool(const std::string& key) const {
  const SchemaEntry& entry = entry_for(key, ValueType::Bool);
  const ConfigValue* value = explicit_value(key);
  return std::get<bool>(value ? *value : entry.default_value);
}

std::string Config::get_string(const std::string& key) const {
  const SchemaEntry& entry = entry_for(key, ValueType::String);
  const ConfigValue* value = explicit_value(key);
  return std::get<std::string>(value ? *value : entry.default_value);
}

std::vector<std::string> Config::get_string_list(const std::string& key) const {
  const SchemaEntry& entry = entry_for(key, ValueType::StringList);
  const ConfigValue* value = explicit_value(key);
  return std::get<std::vector<std::string>>(value ? *value : entry.default_value);
}

bool Config::is_set(const std::string& key) const {
  if (schema_->find_key(key)) return values_.count(key) > 0;
  const SchemaSection* section = schema_->find_section(key.substr(0, key.find('.')));
  if (!section || !section->open || key.find('.') == std::string::npos)
    throw std::logic_error("weft::Config: '" + key + "' is not a key of the schema");
  return static_cast<bool>(open_sections_.at_path(key));
}

std::string Config::origin(const std::string& key) const {
  if (!is_set(key)) return "default";
  return origin_of(origins_, key);
}

toml::table Config::section_table(const std::string& section) const {
  const SchemaSection* found = schema_->find_section(section);
  if (!found || !found->open)
    throw std::logic_error("weft::Config: '" + section + "' is not an open config section");
  const toml::table* table = open_sections_.get_as<toml::table>(section);
  return table ? *table : toml::table{};
}

std::string Config::to_toml() const {
  std::ostringstream out;
  for (const auto& section : schema_->sections) {
    if (section.open) continue;
    out << "[" << section.name << "]\n";
    for (const auto& entry : schema_->entries) {
      if (entry.section() != section.name) continue;
      const ConfigValue* value = explicit_value(entry.key);
      if (value == nullptr && !entry.default_text.empty()) {  // left to the run: stays unset when read back
        out << "# " << entry.name() << ": " << entry.default_text << "\n";
        continue;
      }
      out << entry.name() << " = " << value_to_toml(value ? *value : entry.default_value) << "\n";
    }
    out << "\n";
  }
  for (const auto& section : schema_->sections) {
    const toml::table* table = open_sections_.get_as<toml::table>(section.name);
    if (!section.open || !table || table->empty()) continue;
    toml::table wrapper{{section.name, *table}};
    out << toml::toml_formatter{wrapper, toml::format_flags::none} << "\n";
  }
  return out.str();
}

std::string Config::hash() const { return hex64(hash64(to_toml())); }

}  // namespace weft
