-- Argo CD health of a PodMigration (podmotion.io/v1alpha1).
-- Healthy: Succeeded (the pod runs on the target node, or a dry run passed).
-- Degraded: Failed or Aborted (the source pod was resumed), or Stalled (the pre-flight
--   checks cannot pass without a change, e.g. no target node fits).
-- Progressing: everything else, including a status for an older generation.
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
  hs.message = "Waiting for the operator to pick up the migration"
  return hs
end

local st = obj.status
local generation = obj.metadata.generation
if generation ~= nil and (st.observedGeneration == nil or st.observedGeneration < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end

local phase = st.phase or "Pending"
if phase == "Succeeded" then
  hs.status = "Healthy"
  hs.message = describe(condition("Ready"), "Succeeded")
  return hs
end

if phase == "Failed" or phase == "Aborted" then
  hs.status = "Degraded"
  local reason = st.failureReason or phase
  if st.failureMessage ~= nil and st.failureMessage ~= "" then
    hs.message = phase .. " (" .. reason .. "): " .. st.failureMessage
  else
    hs.message = phase .. " (" .. reason .. ")"
  end
  return hs
end

local stalled = condition("Stalled")
if stalled ~= nil and stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = describe(stalled, "Stalled")
  return hs
end

hs.status = "Progressing"
local message = phase
local reconciling = condition("Reconciling")
if reconciling ~= nil and reconciling.status == "True" and reconciling.message ~= nil and reconciling.message ~= "" and reconciling.message ~= phase then
  message = phase .. ": " .. reconciling.message
end
if st.progress ~= nil and st.progress.iteration ~= nil then
  message = message .. " (round " .. tostring(st.progress.iteration) .. ")"
end
hs.message = message
return hs
