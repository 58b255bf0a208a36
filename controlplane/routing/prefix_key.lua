-- Prefix affinity's key, in Envoy's Lua filter (controlplane/routing/translate.py installs it).
--
-- The key is the leading part of an OpenAI request body, as raw bytes, without parsing the
-- JSON: for chat, the text of the first N objects of the "messages" array (the system
-- prompt, then the early turns), at most max_bytes; for completions, the first
-- prompt_bytes bytes after "prompt":. The same body gives the same key on every proxy, so
-- placement needs no shared state. The key goes to dynamic metadata
-- (controlplane.affinity_prefix); the set_filter_state filter makes it hashable state, and
-- the route's hash policy hashes it (maglev or ring hash, bounded load).
--
-- Where no key can be derived (no body, no "messages" or "prompt"), nothing is set and the
-- route's hash policy finds no value: Envoy picks as for a request without a key.
-- The settings come from the route's metadata, read after the body (by then the route is
-- the one chosen by the body's model): a model without prefix affinity costs a handle to
-- the already buffered body and one metadata lookup.
--
-- A picked model with a tokenizer (route metadata prompt_max_bytes) also gets its whole body,
-- up to that many bytes, as controlplane.prompt: the picker matches the prompt's blocks
-- against the servers' KV events. The picker still gets request headers only (the metadata
-- rides with them), so a picker that is down costs nothing but its timeout.

local function messages_key(s, first, want, last)
  -- s: the body; first: the index just after "messages":[ ; last: the last index to read.
  local depth, count, pos = 0, 0, first
  while pos <= last do
    local a = string.find(s, '[{}%[%]"]', pos)
    if a == nil or a > last then
      break
    end
    local c = string.sub(s, a, a)
    if c == '"' then
      local q = a + 1
      while true do
        local b = string.find(s, '["\\]', q)
        if b == nil or b > last then
          return string.sub(s, first, last)
        end
        if string.sub(s, b, b) == "\\" then
          q = b + 2
        else
          pos = b + 1
          break
        end
      end
    elseif c == "{" or c == "[" then
      depth = depth + 1
      pos = a + 1
    else
      if depth == 0 then
        -- the array ended before `want` messages: all of it is the key
        if a > first then
          return string.sub(s, first, a - 1)
        end
        return nil
      end
      depth = depth - 1
      pos = a + 1
      if depth == 0 and c == "}" then
        count = count + 1
        if count >= want then
          return string.sub(s, first, a)
        end
      end
    end
  end
  -- max_bytes reached inside the first messages (a long system prompt): its first bytes
  return string.sub(s, first, last)
end

function envoy_on_request(handle)
  local body = handle:body()
  if body == nil then
    return
  end
  local settings = handle:metadata()
  local want = settings:get("prefix_messages")
  local prompt_max = settings:get("prompt_max_bytes")
  if want == nil and prompt_max == nil then
    return
  end
  local n = body:length()
  if n == 0 then
    return
  end
  local s = body:getBytes(0, n)
  if prompt_max ~= nil and n <= prompt_max then
    -- The whole body, for the picker's precise prefix index (a model with a tokenizer): the
    -- picker reads the prompt from it and tokenizes it as the server will.
    handle:streamInfo():dynamicMetadata():set("controlplane", "prompt", s)
  end
  if want == nil then
    return
  end
  local key = nil
  local _, m = string.find(s, '"messages"%s*:%s*%[')
  if m ~= nil then
    local last = math.min(n, m + settings:get("prefix_max_bytes"))
    key = messages_key(s, m + 1, want, last)
  else
    local _, p = string.find(s, '"prompt"%s*:%s*')
    if p ~= nil then
      key = string.sub(s, p + 1, math.min(n, p + settings:get("prefix_prompt_bytes")))
    end
  end
  if key ~= nil and #key > 0 then
    handle:streamInfo():dynamicMetadata():set("controlplane", "affinity_prefix", key)
  end
end
