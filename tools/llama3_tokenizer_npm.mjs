// Helper for tools/llama3_tokenizer_from_npm.sh; run with node from a directory where the npm
// package llama3-tokenizer-js is installed (its bundle holds Llama 3's vocabulary and merges).
//
//   node llama3_tokenizer_npm.mjs build OUT_JSON    writes an HF-format Llama 3 tokenizer.json
//   node llama3_tokenizer_npm.mjs encode FILE...    prints the package's ids for each file's text
//                                                   (no BOS/EOS) as a JSON array of arrays
import fs from 'fs'
import llama3Tokenizer from 'llama3-tokenizer-js'

const LLAMA3_SPLIT_REGEX =
  "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
const FIRST_SPECIAL_ID = 128000

function buildTokenizerJson() {
  const tokens = llama3Tokenizer.vocabById
  const vocab = {}
  for (let id = 0; id < FIRST_SPECIAL_ID; id++) vocab[tokens[id]] = id
  const merges = [...llama3Tokenizer.merges.entries()].sort((a, b) => a[1] - b[1]).map(([merge]) => merge)
  const addedTokens = tokens.slice(FIRST_SPECIAL_ID).map((content, i) => ({
    id: FIRST_SPECIAL_ID + i, content, single_word: false, lstrip: false, rstrip: false,
    normalized: false, special: true,
  }))
  const byteLevel = { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: false }
  return {
    version: '1.0',
    truncation: null,
    padding: null,
    added_tokens: addedTokens,
    normalizer: null,
    pre_tokenizer: {
      type: 'Sequence',
      pretokenizers: [
        { type: 'Split', pattern: { Regex: LLAMA3_SPLIT_REGEX }, behavior: 'Isolated', invert: false },
        byteLevel,
      ],
    },
    post_processor: {
      type: 'Sequence',
      processors: [
        { ...byteLevel, use_regex: true },
        {
          type: 'TemplateProcessing',
          single: [{ SpecialToken: { id: '<|begin_of_text|>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }],
          pair: [
            { SpecialToken: { id: '<|begin_of_text|>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } },
            { SpecialToken: { id: '<|begin_of_text|>', type_id: 1 } }, { Sequence: { id: 'B', type_id: 1 } },
          ],
          special_tokens: {
            '<|begin_of_text|>': { id: '<|begin_of_text|>', ids: [FIRST_SPECIAL_ID], tokens: ['<|begin_of_text|>'] },
          },
        },
      ],
    },
    decoder: { type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true },
    model: {
      type: 'BPE', dropout: null, unk_token: null, continuing_subword_prefix: null, end_of_word_suffix: null,
      fuse_unk: false, byte_fallback: false, ignore_merges: true, vocab, merges,
    },
  }
}

const [command, ...args] = process.argv.slice(2)
if (command === 'build' && args.length === 1) {
  fs.writeFileSync(args[0], JSON.stringify(buildTokenizerJson()))
} else if (command === 'encode' && args.length > 0) {
  const ids = args.map(file => llama3Tokenizer.encode(fs.readFileSync(file, 'utf8'), { bos: false, eos: false }))
  process.stdout.write(JSON.stringify(ids) + '\n')
} else {
  console.error('usage: node llama3_tokenizer_npm.mjs build OUT_JSON | encode FILE...')
  process.exit(2)
}
