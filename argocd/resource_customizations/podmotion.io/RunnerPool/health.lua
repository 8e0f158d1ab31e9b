-- Argo CD health of a RunnerPool (podmotion.io/v1alpha1).
-- Healthy: Ready (the Runner DaemonSet is rolled out and matches the contract).
-- Degraded: Stalled (Pod Security rejects the Runner pods, preflight failed on a node,
--   no eligible node, server unresolved), or the Degraded condition is True.
-- Progressing: rolling out, repairing drift, or a status for an older generation.
local hs = {}

local function condition(ctype)
  if obj.status ~= nil and obj.status.conditions ~= nil then
    for _, c in ipairs(obj.status.conditions) do
      if c.type == ctype then
        return c
      end
    end
  end
  return nil
end

local function describe(c, fallback)
  if c == nil then
    return fallback
  end
  local text = c.reason or fallback
  if c.message ~= nil and c.message ~= "" then
    text = text .. ": " .. c.message
  end
  return text
end

if obj.status == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to pick up the pool"
  return hs
end

local st = obj.status
local generation = obj.metadata.generation
if generation ~= nil and (st.observedGeneration == nil or st.observedGeneration < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end

local stalled = condition("Stalled")
if stalled ~= nil and stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = describe(stalled, "Stalled")
  return hs
end

local degraded = condition("Degraded")
if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = describe(degraded, "Degraded")
  return hs
end

local ready = condition("Ready")
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = describe(ready, "Ready")
  return hs
end

hs.status = "Progressing"
local reconciling = condition("Reconciling")
if reconciling ~= nil and reconciling.status == "True" then
  hs.message = describe(reconciling, "Reconciling")
else
  hs.message = tostring(st.readyNodes or 0) .. "/" .. tostring(st.desiredNodes or 0) .. " nodes ready"
end
return hs
